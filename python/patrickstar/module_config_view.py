"""`model.config` on the engine: PatrickStar's config and the user's module's config as one.

Hugging Face scripts read and set their model's config through whatever wraps it
(`model.config.use_cache = False` before gradient checkpointing, `model.config.vocab_size`,
`model.config.pad_token_id = ...`); the engine's own `config` used to hide it, so reads raised
AttributeError and writes raised FrozenInstanceError. The view reads PatrickStar's fields first
(`model.config.default_chunk_size`, as before) and everything else from the module's `config`;
a write goes to the module's config, and one to a PatrickStar field raises naming it (the engine
was built with it: changing it now would change nothing)."""
from __future__ import annotations

import dataclasses

from .config import Config

__all__ = ["ModuleConfigView"]


class ModuleConfigView:
    __slots__ = ("_patrickstar", "_module_config")

    def __init__(self, patrickstar: Config, module_config):
        object.__setattr__(self, "_patrickstar", patrickstar)
        object.__setattr__(self, "_module_config", module_config)

    def __getattr__(self, name: str):
        try:
            return getattr(self._patrickstar, name)
        except AttributeError:
            pass
        if self._module_config is None:
            raise AttributeError(f"PatrickStar's config has no field '{name}' (and the module "
                                 f"has no 'config' attribute)")
        try:
            return getattr(self._module_config, name)
        except AttributeError:
            raise AttributeError(
                f"neither PatrickStar's config nor the module's "
                f"{type(self._module_config).__name__} has an attribute '{name}'") from None

    def __setattr__(self, name: str, value) -> None:
        if name in {field.name for field in dataclasses.fields(self._patrickstar)}:
            raise AttributeError(
                f"model.config.{name} is PatrickStar's config key '{name}', fixed when "
                f"patrickstar.initialize() built the engine; pass the value in the config given "
                f"to initialize() instead")
        if self._module_config is None:
            raise AttributeError(f"cannot set '{name}': the module has no 'config' attribute "
                                 f"and PatrickStar's config is fixed at initialize()")
        setattr(self._module_config, name, value)

    def __delattr__(self, name: str) -> None:
        if self._module_config is None:
            raise AttributeError(name)
        delattr(self._module_config, name)

    def __eq__(self, other) -> bool:
        if isinstance(other, ModuleConfigView):
            return (self._patrickstar == other._patrickstar
                    and self._module_config is other._module_config)
        return other is self._module_config or other == self._patrickstar

    __hash__ = None

    def __repr__(self) -> str:
        if self._module_config is None:
            return repr(self._patrickstar)
        return f"{self._module_config!r}\n(and PatrickStar's {self._patrickstar!r})"
