"""Image name translation: fixed names, regexps, precedence, and errors that point at the rule."""

from __future__ import annotations

from typing import Any

import pytest

from vkubelet.providers.vm._translate import (
    ImageSource,
    ImageTranslator,
    TranslationError,
    parse_rules,
    redact_url,
)

DIGEST = "ab" * 32
FILE = "/etc/vkubelet/vm.yaml"


def translator(rules: list[dict[str, Any]], prefix: str = "vm.vkubelet.io") -> ImageTranslator:
    return ImageTranslator(prefix, parse_rules({"translations": rules}, origin=FILE))


def test_a_fixed_name_translates_to_its_url_and_digest() -> None:
    t = translator([{"name": "tiny", "url": "https://img.example/tiny.qcow2", "sha256": DIGEST}])
    assert t.translate("vm.vkubelet.io/tiny") == ImageSource(
        "vm.vkubelet.io/tiny", "https://img.example/tiny.qcow2", DIGEST
    )


def test_a_tag_is_ignored_when_no_rule_names_it() -> None:
    t = translator(
        [
            {"name": "tiny", "url": "https://img.example/tiny.qcow2"},
            {"name": "tiny:2", "url": "https://img.example/tiny-2.qcow2"},
        ]
    )
    assert t.translate("vm.vkubelet.io/tiny:latest").url == "https://img.example/tiny.qcow2"
    assert t.translate("vm.vkubelet.io/tiny:2").url == "https://img.example/tiny-2.qcow2"


@pytest.mark.parametrize(
    "url",
    [
        "https://img.example/debian-$1-$2.qcow2",
        "https://img.example/debian-${1}-${2}.qcow2",
        r"https://img.example/debian-\1-\2.qcow2",
        "https://img.example/debian-${major}-${arch}.qcow2",
    ],
)
def test_regexp_groups_are_substituted_in_every_spelling(url: str) -> None:
    t = translator([{"regexp": r"debian/(?P<major>\d+)-(?P<arch>\w+)", "url": url}])
    source = t.translate("vm.vkubelet.io/debian/12-amd64")
    assert source.url == "https://img.example/debian-12-amd64.qcow2"


def test_a_double_dollar_is_a_literal_dollar() -> None:
    t = translator([{"regexp": "(.*)", "url": "https://img.example/$$/$1"}])
    assert t.translate("vm.vkubelet.io/x").url == "https://img.example/$/x"


def test_a_regexp_must_match_the_whole_name() -> None:
    t = translator([{"regexp": "deb", "url": "https://img.example/deb.qcow2"}])
    with pytest.raises(TranslationError, match="no translation rule"):
        t.translate("vm.vkubelet.io/debian")


def test_fixed_names_beat_regexps_whatever_the_order() -> None:
    t = translator(
        [
            {"regexp": "(.*)", "url": "https://mirror.example/$1"},
            {"name": "tiny", "url": "https://img.example/tiny.qcow2"},
        ]
    )
    assert t.translate("vm.vkubelet.io/tiny").url == "https://img.example/tiny.qcow2"
    assert t.translate("vm.vkubelet.io/other").url == "https://mirror.example/other"


def test_configmap_rules_win_over_the_config_file() -> None:
    base = translator(
        [
            {"name": "tiny", "url": "https://img.example/tiny.qcow2"},
            {"name": "keep", "url": "https://img.example/keep.qcow2"},
        ]
    )
    configmap = {"images.yaml": "translations:\n- regexp: 'ti.*'\n  url: file:///srv/tiny.img\n"}
    merged = base.with_overrides(parse_rules(configmap, origin="kube-system/vm-images"))
    assert merged.translate("vm.vkubelet.io/tiny").url == "file:///srv/tiny.img"
    assert merged.translate("vm.vkubelet.io/keep").url == "https://img.example/keep.qcow2"
    # New ConfigMap contents replace the old overrides instead of stacking on them.
    assert merged.with_overrides([]).translate("vm.vkubelet.io/tiny").url.startswith("https:")


def test_the_prefix_is_configurable_and_other_images_are_refused() -> None:
    t = translator([{"name": "tiny", "url": "https://img.example/t"}], prefix="vms.example.com")
    assert t.handles("vms.example.com/tiny")
    assert t.translate("vms.example.com/tiny").url == "https://img.example/t"
    assert not t.handles("nginx:1.27")
    with pytest.raises(TranslationError, match=r"'nginx:1.27' is not a VM image.*vms.example.com/"):
        t.translate("nginx:1.27")


def test_an_unknown_name_names_the_image() -> None:
    with pytest.raises(TranslationError, match=r"image 'vm\.vkubelet\.io/nope'"):
        translator([]).translate("vm.vkubelet.io/nope")


@pytest.mark.parametrize(
    ("rule", "field", "why"),
    [
        ({"name": "a", "url": "ftp://x/y"}, "translations[0].url", "scheme 'ftp'"),
        ({"name": "a", "url": "file:relative.img"}, "translations[0].url", "absolute path"),
        ({"name": "a", "url": "https:///nohost"}, "translations[0].url", "no host"),
        ({"name": "a"}, "translations[0].url", "required"),
        ({"url": "https://x/y"}, "translations[0]", "exactly one of name and regexp"),
        ({"name": "a", "regexp": "a", "url": "https://x"}, "translations[0]", "exactly one"),
        ({"regexp": "(", "url": "https://x/y"}, "translations[0].regexp", "missing"),
        ({"regexp": "(a)", "url": "https://x/$2"}, "translations[0].url", "group 2"),
        ({"regexp": "(a)", "url": "ftp://x/$1"}, "translations[0].url", "scheme 'ftp'"),
        ({"name": "a", "url": "https://x", "sha256": "abc"}, "translations[0].sha256", "64 hex"),
        ({"name": "a", "url": "https://x", "transport": "t"}, "translations[0]", "transport"),
    ],
)
def test_a_bad_rule_is_reported_with_its_origin_and_field(
    rule: dict[str, Any], field: str, why: str
) -> None:
    with pytest.raises(TranslationError) as caught:
        parse_rules({"translations": [rule]}, origin=FILE)
    message = str(caught.value)
    assert message.startswith(f"{FILE}: {field}")
    assert why in message


def test_a_duplicate_fixed_name_is_an_error() -> None:
    rules = [{"name": "a", "url": "https://x/1"}, {"name": "a", "url": "https://x/2"}]
    with pytest.raises(TranslationError, match=r"translations\[1\].name: 'a'.*translations\[0\]"):
        parse_rules({"translations": rules}, origin=FILE)


def test_broken_configmap_yaml_names_the_configmap_key_and_line() -> None:
    data = {"images.yaml": "translations:\n  - name: a\n   url: [\n"}
    with pytest.raises(TranslationError, match=r"^kube-system/vm-images: data\[images.yaml\]:"):
        parse_rules(data, origin="kube-system/vm-images")


def test_a_configmap_rule_error_names_the_key_and_rule() -> None:
    data = {"b.yaml": "translations:\n- name: a\n  url: gopher://x\n"}
    with pytest.raises(TranslationError, match=r"ns/cm: data\[b.yaml\].translations\[0\].url"):
        parse_rules(data, origin="ns/cm")


def test_sha256_accepts_the_prefixed_upper_case_form() -> None:
    rules = parse_rules(
        {"translations": [{"name": "a", "url": "https://x/a", "sha256": "sha256:" + "AB" * 32}]},
        origin=FILE,
    )
    assert rules[0].sha256 == DIGEST


def test_a_substituted_url_that_is_not_allowed_names_the_image_and_rule() -> None:
    t = translator([{"regexp": "(.*)", "url": "$1://x/y"}])
    with pytest.raises(TranslationError, match=r"image 'vm.vkubelet.io/ftp'.*translations\[0\]"):
        t.translate("vm.vkubelet.io/ftp")


@pytest.mark.parametrize(
    "image", ["../../var/lib/vkubelet/volumes/pvc-x", "a/%2e%2e/b", "a\\..\\b", "/etc/passwd"]
)
def test_an_image_name_cannot_climb_out_of_the_rules_directory(image: str) -> None:
    t = translator([{"regexp": "(.+)", "url": "file:///srv/images/$1.qcow2"}])
    with pytest.raises(TranslationError, match=r"may not contain '\.\.'"):
        t.translate(f"vm.vkubelet.io/{image}")
    assert t.translate("vm.vkubelet.io/debian/12").url == "file:///srv/images/debian/12.qcow2"


def test_redacted_urls_keep_no_credentials_or_query() -> None:
    redacted = redact_url("https://user:hunter2@img.example:8443/a.qcow2?X-Amz-Signature=s3cr3t")
    assert "hunter2" not in redacted and "s3cr3t" not in redacted and "user" not in redacted
    assert redacted.startswith("https://***@img.example:8443/a.qcow2")
