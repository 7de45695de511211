"""Image names to image URLs: the VM provider's answer to "what is `vm.vkubelet.io/tiny`?".

A pod's `image` must read `<prefix>/<name>` (default prefix `vm.vkubelet.io`): Docker-style image
names cannot carry a URL (no colons, capitals, ports or queries), so, as in virtlet, rules map names
to URLs. The rule data is the same in the provider's config file and in a ConfigMap:

    translations:
      - name: tiny                               # a fixed name ...
        url: https://images.example/tiny.qcow2
        sha256: 3a7bd3e2...                      # optional: verified after download
      - regexp: 'debian/(\\d+)'                  # ... or a regexp matching the whole name
        url: https://cloud.debian.org/images/cloud/$1/latest/debian-$1-genericcloud-amd64.qcow2

A ConfigMap holds the same YAML as the value of each of its data keys (any key names). Groups are
written `$1`, `${1}`, `${name}` or `\\1`; `$$` is a literal dollar. URLs are http, https or file.

Precedence: the ConfigMap's rules (`with_overrides`) come before the config file's, and within
each source fixed names beat regexps, which are tried in order. A name is tried as written, then
without its `:tag` (virtlet ignores tags), so `vm.vkubelet.io/tiny:latest` finds the rule `tiny`.

Errors name the image, the rule's origin (file path or ConfigMap `ns/name`) and the field, because
whoever reads a pod's `Waiting` reason must find the line to fix.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import yaml

__all__ = [
    "DEFAULT_PREFIX",
    "ImageSource",
    "ImageTranslator",
    "TranslationError",
    "TranslationRule",
    "parse_rules",
    "redact_url",
]

DEFAULT_PREFIX: Final = "vm.vkubelet.io"
_SCHEMES: Final = ("http", "https", "file")
_RULE_KEYS: Final = {"name", "regexp", "url", "sha256"}
_SHA256: Final = re.compile(r"[0-9a-f]{64}")
# $1, ${1}, ${name}, \1 and the escape $$.
_GROUP_REF: Final = re.compile(r"\$\$|\$(\d+)|\$\{(\w+)\}|\\(\d+)")


class TranslationError(ValueError):
    """An image name no rule translates, or a rule that cannot be used (the message says which)."""


@dataclass(frozen=True)
class ImageSource:
    """What a pod's image name translates to."""

    name: str
    url: str
    sha256: str | None = None


@dataclass(frozen=True)
class TranslationRule:
    """One rule; `origin` and `field` say where it was written, for error messages."""

    url: str
    origin: str
    field: str
    name: str | None = None
    regexp: re.Pattern[str] | None = None
    sha256: str | None = None

    @property
    def where(self) -> str:
        return f"{self.origin}: {self.field}"


def redact_url(url: str) -> str:
    """The URL without credentials or query (presigned URLs carry tokens there): safe to log."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host + (f":{port}" if port is not None else "")
    if parts.username is not None or parts.password is not None:
        netloc = "***@" + netloc
    query = "..." if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _check_url(url: str, where: str) -> None:
    """Reject what the store cannot fetch. `url` is a complete URL (after substitution)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise TranslationError(f"{where}.url: not a URL ({exc})") from None
    if parts.scheme not in _SCHEMES:
        raise TranslationError(
            f"{where}.url: scheme {parts.scheme or '(none)'!r} is not one of "
            f"{', '.join(_SCHEMES)} in {redact_url(url)}"
        )
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise TranslationError(f"{where}.url: a file URL needs an absolute path: {url}")
    elif not parts.hostname:
        raise TranslationError(f"{where}.url: no host in {redact_url(url)}")


def _parse_sha256(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TranslationError(f"{where}.sha256: must be a string of 64 hex digits")
    digest = value.lower().removeprefix("sha256:")
    if not _SHA256.fullmatch(digest):
        raise TranslationError(f"{where}.sha256: must be 64 hex digits, got {value!r}")
    return digest


def _parse_rule(item: Any, origin: str, field: str) -> TranslationRule:
    where = f"{origin}: {field}"
    if not isinstance(item, Mapping):
        raise TranslationError(f"{where}: must be a mapping with name or regexp, and url")
    unknown = sorted(set(item) - _RULE_KEYS)
    if unknown:
        raise TranslationError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
    name, regexp, url = item.get("name"), item.get("regexp"), item.get("url")
    if (name is None) == (regexp is None):
        raise TranslationError(f"{where}: exactly one of name and regexp is needed")
    if not isinstance(url, str) or not url:
        raise TranslationError(f"{where}.url: required, a string")
    sha256 = _parse_sha256(item.get("sha256"), where)
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TranslationError(f"{where}.name: must be a non-empty string")
        _check_url(url, where)
        return TranslationRule(url=url, origin=origin, field=field, name=name, sha256=sha256)
    if not isinstance(regexp, str) or not regexp:
        raise TranslationError(f"{where}.regexp: must be a non-empty string")
    try:
        pattern = re.compile(regexp)
    except re.error as exc:
        raise TranslationError(f"{where}.regexp: {exc}") from None
    for ref in _GROUP_REF.finditer(url):
        group = ref.group(1) or ref.group(2) or ref.group(3)
        if group is None:
            continue
        known = int(group) <= pattern.groups if group.isdigit() else group in pattern.groupindex
        if not known:
            raise TranslationError(f"{where}.url: group {group} is not in the regexp")
    scheme_part = url.split(":", 1)[0]
    if "$" not in scheme_part and "\\" not in scheme_part:
        _check_url(_GROUP_REF.sub("x", url), where)  # the parts a match cannot change
    return TranslationRule(url=url, origin=origin, field=field, regexp=pattern, sha256=sha256)


def _parse_translations(doc: Any, origin: str, prefix: str) -> list[TranslationRule]:
    if not isinstance(doc, Mapping):
        raise TranslationError(f"{origin}: {prefix or 'top level'}: must be a mapping")
    unknown = sorted(set(doc) - {"translations"})
    if unknown:
        field = ", ".join(f"{prefix}{key}" for key in map(str, unknown))
        raise TranslationError(f"{origin}: unknown field(s) {field}")
    items = doc.get("translations")
    if items is None:
        return []
    if not isinstance(items, Sequence) or isinstance(items, str):
        raise TranslationError(f"{origin}: {prefix}translations: must be a list")
    return [
        _parse_rule(item, origin, f"{prefix}translations[{index}]")
        for index, item in enumerate(items)
    ]


def parse_rules(data: Mapping[str, Any], *, origin: str) -> list[TranslationRule]:
    """Rules from a config file's mapping (`{translations: [...]}`) or a ConfigMap's `data`
    (every value a YAML document of that shape). `origin` names the source in errors."""
    if "translations" in data or not data:
        rules = _parse_translations(data, origin, "")
    else:
        rules = []
        for key in sorted(data):
            text = data[key]
            field = f"data[{key}]"
            if not isinstance(text, str):
                raise TranslationError(f"{origin}: {field}: must be YAML text (a string)")
            try:
                doc = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                line = f" line {mark.line + 1}" if mark is not None else ""
                problem = getattr(exc, "problem", None) or str(exc)
                raise TranslationError(f"{origin}: {field}:{line}: {problem}") from None
            if doc is None:
                continue
            rules.extend(_parse_translations(doc, origin, f"{field}."))
    seen: dict[str, TranslationRule] = {}
    for rule in rules:
        if rule.name is None:
            continue
        if rule.name in seen:
            raise TranslationError(
                f"{rule.where}.name: {rule.name!r} is also defined at {seen[rule.name].field}"
            )
        seen[rule.name] = rule
    return rules


def _substitute(rule: TranslationRule, match: re.Match[str], image: str) -> str:
    def group(ref: re.Match[str]) -> str:
        if ref.group(0) == "$$":
            return "$"
        key = ref.group(1) or ref.group(2) or ref.group(3)
        value = match.group(int(key) if key.isdigit() else key) or ""
        # A pod's image name goes into the URL: it must not climb out of the rule's
        # directory (`file:///srv/images/$1.qcow2` with `../../var/lib/...`). No image
        # reference has these (its grammar allows no `..`, `%`, `\` or leading `/`).
        if ".." in value or "%" in value or "\\" in value or value.startswith("/"):
            raise TranslationError(
                f"image {image!r}: the part the rule {rule.where} takes from it ({value!r}) "
                "may not contain '..', '%' or '\\', nor start with '/'"
            )
        return value

    url = _GROUP_REF.sub(group, rule.url)
    try:
        _check_url(url, rule.where)
    except TranslationError as exc:
        raise TranslationError(f"image {image!r}: {exc}") from None
    return url


class _Layer:
    """One source's rules, split the way lookups use them."""

    def __init__(self, rules: Sequence[TranslationRule]) -> None:
        self.rules = tuple(rules)
        self.fixed = {rule.name: rule for rule in rules if rule.name is not None}
        self.regexps = [rule for rule in rules if rule.regexp is not None]

    def find(self, names: Sequence[str]) -> tuple[TranslationRule, re.Match[str] | None] | None:
        for name in names:
            if name in self.fixed:
                return self.fixed[name], None
        for name in names:
            for rule in self.regexps:
                assert rule.regexp is not None
                match = rule.regexp.fullmatch(name)
                if match is not None:
                    return rule, match
        return None


class ImageTranslator:
    """Translate `<prefix>/<name>` images by the config file's rules and the ConfigMap's."""

    def __init__(
        self,
        prefix: str,
        rules: Sequence[TranslationRule],
        *,
        overrides: Sequence[TranslationRule] = (),
    ) -> None:
        self.prefix = prefix.rstrip("/") or DEFAULT_PREFIX
        self._base = _Layer(rules)
        self._overrides = _Layer(overrides)

    def with_overrides(self, rules: Sequence[TranslationRule]) -> ImageTranslator:
        """The same file rules under a (new) set of ConfigMap rules, which win. Replaces any
        earlier overrides: call it again with the ConfigMap's new contents when it changes."""
        return ImageTranslator(self.prefix, self._base.rules, overrides=rules)

    def handles(self, image: str) -> bool:
        """Whether the image carries this provider's prefix (others are refused or handed on)."""
        return image.startswith(self.prefix + "/") and len(image) > len(self.prefix) + 1

    def translate(self, image: str) -> ImageSource:
        if not self.handles(image):
            raise TranslationError(
                f"image {image!r} is not a VM image: expected {self.prefix}/<name>"
            )
        rest = image[len(self.prefix) + 1 :]
        names = [rest]
        untagged = _strip_tag(rest)
        if untagged != rest:
            names.append(untagged)
        for layer in (self._overrides, self._base):
            found = layer.find(names)
            if found is None:
                continue
            rule, match = found
            url = rule.url if match is None else _substitute(rule, match, image)
            return ImageSource(name=image, url=url, sha256=rule.sha256)
        raise TranslationError(
            f"image {image!r}: no translation rule matches {rest!r} "
            "(config file and ConfigMap rules searched)"
        )


def _strip_tag(name: str) -> str:
    """`tiny:1.0` -> `tiny`, `tiny@sha256:...` -> `tiny` (the tag after the last slash only)."""
    name = name.split("@", 1)[0]
    head, slash, last = name.rpartition("/")
    return head + slash + last.split(":", 1)[0]
