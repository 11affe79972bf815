"""The torch patrickstar._C was compiled against, compared with the running one before _C loads.

Note [The torch _C was built with]
_C links LibTorch's C++ symbols, and those change between torch's minor releases (patch
releases keep them). torch is no declared dependency (pyproject.toml), so pip lets a user upgrade
or downgrade torch under an installed patrickstar; loading _C then failed in the dynamic loader
with `undefined symbol: _ZN3c10...`, naming neither version nor what to do, or loaded and broke
later. The build records torch.__version__ in _build_info.py (bindings/CMakeLists.txt), and
`import patrickstar` compares major.minor before it loads _C. A tree run from its sources with
only _C beside it (no _build_info.py) is not checked.
"""
from __future__ import annotations

__all__ = ["check_built_torch"]


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def check_built_torch(running: str, built: str | None = None) -> None:
    """Raises ImportError when _C was built against another torch minor release than `running`.
    `built` defaults to the version _build_info.py recorded (no check when there is none)."""
    if built is None:
        try:
            from ._build_info import TORCH_VERSION as built
        except ImportError:
            return
    if _minor(built) != _minor(running):
        raise ImportError(
            f"patrickstar._C was built against torch {built}, but torch {running} is installed: "
            f"torch's C++ symbols differ between minor releases. Reinstall torch=={built} or "
            f"rebuild patrickstar with this torch (pip install --no-build-isolation "
            f"--force-reinstall --no-deps <patrickstar source>)")
