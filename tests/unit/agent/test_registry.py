"""Loading a provider: installed names, `module:factory` and files, with errors that name what
was given."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet.agent import NodeEventRouter, build_provider
from vkubelet.node import NodeSpec, ProviderLoadError, UnknownProvider, load_provider
from vkubelet.node._registry import provider_label
from vkubelet.providers.mock import MockProvider, create

from ..node.helpers import settings


def spec(provider: str) -> NodeSpec:
    return NodeSpec(settings(name="vk-a", provider=provider))


def test_an_installed_provider_loads_by_its_name() -> None:
    assert load_provider("mock") is create


def test_a_provider_loads_from_module_and_factory() -> None:
    assert load_provider("vkubelet.providers.mock:create") is create


def test_a_provider_loads_from_a_file_with_create_or_a_named_factory(tmp_path: Path) -> None:
    path = tmp_path / "mine.py"
    path.write_text(
        "from vkubelet.providers.mock import MockConfig, MockProvider\n"
        "def create(context):\n    return MockProvider(context.node_name, MockConfig())\n"
        "def other(context):\n    return MockProvider('other', MockConfig())\n"
    )
    built = build_provider(spec(str(path)), NodeEventRouter())
    assert isinstance(built, MockProvider) and built.node_name == "vk-a"
    other = build_provider(spec(f"{path}:other"), NodeEventRouter())
    assert isinstance(other, MockProvider) and other.node_name == "other"


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("nosuch", "not an installed provider"),
        ("no_such_module_xyz:create", "module 'no_such_module_xyz' not found"),
        ("vkubelet.providers.mock:nope", "has no attribute 'nope'"),
        ("vkubelet.providers.mock:__doc__", "is not callable"),
        ("./does/not/exist.py", "no such file"),
    ],
)
def test_a_provider_that_cannot_be_loaded_is_a_clear_error(given: str, says: str) -> None:
    with pytest.raises(UnknownProvider) as caught:
        load_provider(given)
    assert says in str(caught.value)
    assert repr(given) in str(caught.value)


def test_a_file_that_fails_to_import_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('half-written')\n")
    with pytest.raises(UnknownProvider, match=r"loading .*broken\.py.* failed: RuntimeError: half"):
        load_provider(str(path))


def test_a_factory_that_raises_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "raising.py"
    path.write_text("def create(context):\n    raise ValueError('no inventory file')\n")
    with pytest.raises(ProviderLoadError) as caught:
        build_provider(spec(str(path)), NodeEventRouter())
    message = str(caught.value)
    assert "its factory raised ValueError: no inventory file" in message
    assert str(path) in message


def test_a_factory_that_returns_no_provider_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "wrong.py"
    path.write_text("def create(context):\n    return 42\n")
    with pytest.raises(ProviderLoadError, match="returned a int, neither"):
        build_provider(spec(str(path)), NodeEventRouter())


@pytest.mark.parametrize(
    ("given", "label"),
    [
        ("mock", "mock"),
        ("my_pkg.lab_provider:create", "lab_provider"),
        ("/very/long/path/to/the/tests/recording.py:make", "recording"),
        ("./my provider.py", "my-provider"),
    ],
)
def test_a_provider_given_as_module_or_file_is_named_after_it(given: str, label: str) -> None:
    """The name goes into the node's taint value, which must be a valid label value."""
    assert provider_label(given) == label
