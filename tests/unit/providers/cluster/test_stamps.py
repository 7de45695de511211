"""Owner stamps: only this owner's stamped objects are ever ours to change."""

from __future__ import annotations

import pytest

from vkubelet.providers.cluster import Claim, Owner, claim, dependency_name, is_ours, stamp
from vkubelet.providers.cluster._stamps import describe_owner

from .pods import OTHER, OWNER


def config_map(name: str = "cfg") -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {}}


def test_a_stamped_object_is_ours_and_no_one_elses() -> None:
    obj = stamp(config_map(), OWNER, namespace="shop", name="cfg", uid="u1")
    assert is_ours(obj, OWNER)
    assert not is_ours(obj, OTHER)
    assert not is_ours(obj, Owner("upper-a", "vk-other"))  # another virtual node, same cluster
    assert not is_ours(config_map(), OWNER)  # the user's own lower object
    assert not is_ours(None, OWNER)


def test_the_owner_label_alone_does_not_make_an_object_ours() -> None:
    # A hash collision, or a user copying our label, must not hand the object over.
    obj = {"metadata": {"labels": {"vkubelet.io/owner": OWNER.key}}}
    assert not is_ours(obj, OWNER)


def test_owner_keys_are_label_values_and_stable() -> None:
    long = Owner("c" * 63, "n" * 253)
    assert len(long.key) <= 63 and long.key.isalnum()
    assert Owner("upper-a", "vk-lower").key == OWNER.key
    assert OWNER.key != OTHER.key
    assert OWNER.selector == f"vkubelet.io/owner={OWNER.key}"


def test_claims_decide_create_adopt_replace_or_leave_alone() -> None:
    mine = stamp(config_map(), OWNER, namespace="shop", name="cfg", uid="u1")
    assert claim(None, OWNER, "u1") is Claim.FREE
    assert claim(mine, OWNER, "u1") is Claim.OURS
    assert claim(mine, OWNER, "u2") is Claim.STALE  # a pod of the same name re-created upstairs
    assert claim(mine, OWNER, None) is Claim.OURS
    assert claim(mine, OTHER, "u1") is Claim.TAKEN
    assert claim(config_map(), OWNER, None) is Claim.TAKEN


def test_conflict_messages_say_who_owns_the_object() -> None:
    theirs = stamp(config_map(), OTHER, namespace="shop", name="cfg", uid="u1")
    assert describe_owner(theirs) == "owned by virtual node 'vk-lower' of upper cluster 'upper-b'"
    assert "the lower cluster's own object" in describe_owner(config_map())


@pytest.mark.parametrize("kind", ["ConfigMap", "Secret", "ServiceAccount", "PersistentVolumeClaim"])
def test_two_owners_never_want_the_same_suffixed_name(kind: str) -> None:
    mine = dependency_name(OWNER, kind, "app-config", "suffixed")
    theirs = dependency_name(OTHER, kind, "app-config", "suffixed")
    assert mine != theirs and mine.startswith("app-config-")
    assert dependency_name(OWNER, kind, "app-config", "same") == "app-config"


def test_the_default_service_account_is_never_renamed() -> None:
    assert dependency_name(OWNER, "ServiceAccount", "default", "suffixed") == "default"


def test_long_names_stay_valid_and_distinct() -> None:
    a, b = "a" * 250, "a" * 249 + "b"
    one, two = (dependency_name(OWNER, "Secret", n, "suffixed") for n in (a, b))
    assert len(one) <= 253 and len(two) <= 253 and one != two
    assert one[-1].isalnum()
