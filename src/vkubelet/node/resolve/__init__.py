"""What a pod's containers see, computed as the kubelet computes it, before a provider runs them.

Pure and synchronous: pods, ConfigMaps, Secrets and Services go in as the API's JSON dicts (the
latter three through `Sources`), environments and volume files come out. The agent calls
`resolve_env` for each container and `resolve_volumes` once per pod, and uses
`referenced_objects` to know which objects to watch for changes (`pass_through_references` for
providers that forward pods unresolved). Each concern has its module: `env` (variables),
`expansion` ($(VAR)), `fieldpath` (downward API), `resourcefields`, `podips`, `servicelinks`,
`volumes`, `references`, `jsonvalues` (typed views of untrusted JSON), `sources` (the inputs).
"""

from ...sdk.quantity import QuantityError, divide_ceil, parse_quantity
from ...sdk.volumes import (
    EmptyDirVolume,
    FileContent,
    FilesVolume,
    HostPathVolume,
    OtherVolume,
)
from .env import (
    FAILED_TO_READ_MANDATORY_CONFIGMAP,
    FAILED_TO_READ_MANDATORY_SECRET,
    FAILED_TO_READ_OPTIONAL_CONFIGMAP,
    FAILED_TO_READ_OPTIONAL_SECRET,
    INVALID_ENVIRONMENT_VARIABLE_NAMES,
    MANDATORY_CONFIGMAP_KEY_NOT_FOUND,
    MANDATORY_CONFIGMAP_NOT_FOUND,
    MANDATORY_SECRET_KEY_NOT_FOUND,
    MANDATORY_SECRET_NOT_FOUND,
    OPTIONAL_CONFIGMAP_KEY_NOT_FOUND,
    OPTIONAL_CONFIGMAP_NOT_FOUND,
    OPTIONAL_SECRET_KEY_NOT_FOUND,
    OPTIONAL_SECRET_NOT_FOUND,
    EnvResolutionError,
    EnvResult,
    Event,
    resolve_env,
)
from .expansion import expand, expand_command_and_args
from .references import pass_through_references, referenced_objects
from .sources import SourceReadError
from .volumes import (
    FAILED_MOUNT,
    TokenFile,
    TokenSource,
    VolumeResult,
    clean_volume_path,
    resolve_volumes,
)

__all__ = [
    "FAILED_MOUNT",
    "FAILED_TO_READ_MANDATORY_CONFIGMAP",
    "FAILED_TO_READ_MANDATORY_SECRET",
    "FAILED_TO_READ_OPTIONAL_CONFIGMAP",
    "FAILED_TO_READ_OPTIONAL_SECRET",
    "INVALID_ENVIRONMENT_VARIABLE_NAMES",
    "MANDATORY_CONFIGMAP_KEY_NOT_FOUND",
    "MANDATORY_CONFIGMAP_NOT_FOUND",
    "MANDATORY_SECRET_KEY_NOT_FOUND",
    "MANDATORY_SECRET_NOT_FOUND",
    "OPTIONAL_CONFIGMAP_KEY_NOT_FOUND",
    "OPTIONAL_CONFIGMAP_NOT_FOUND",
    "OPTIONAL_SECRET_KEY_NOT_FOUND",
    "OPTIONAL_SECRET_NOT_FOUND",
    "EmptyDirVolume",
    "EnvResolutionError",
    "EnvResult",
    "Event",
    "FileContent",
    "FilesVolume",
    "HostPathVolume",
    "OtherVolume",
    "QuantityError",
    "SourceReadError",
    "TokenFile",
    "TokenSource",
    "VolumeResult",
    "clean_volume_path",
    "divide_ceil",
    "expand",
    "expand_command_and_args",
    "parse_quantity",
    "pass_through_references",
    "referenced_objects",
    "resolve_env",
    "resolve_volumes",
]
