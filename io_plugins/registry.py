"""Finding IO processor plugins: the `vbatch.io_processor_plugins` entry-point group, and which one a run uses.

A distribution registers a plugin as an entry point of the group (the built-in ones are registered
the same way, in vbatch's own pyproject.toml):

    [project.entry-points."vbatch.io_processor_plugins"]
    prithvi = "vbatch.io_plugins.prithvi:register"

The entry point loads a callable returning the plugin class's dotted path ("pkg.module:Class" or
"pkg.module.Class"), as vLLM's plugins do, or the IOProcessor subclass itself. Loading a plugin
imports its module: only installed distributions are ever imported (nothing from a model folder).

Choice (`select_plugin`): the explicit name (`--plugin`, `LLM(io_processor_plugin=...)`) wins over
the model's config.json key `io_processor_plugin`; neither means no plugin. An unknown name is a
PluginError listing the installed plugins.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from ..engine.errors import ConfigError
from .interface import IOProcessor, PluginConfig

GROUP = "vbatch.io_processor_plugins"


class PluginError(ConfigError):
    """A plugin that is not installed, does not load, or is not an IOProcessor."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__("plugin", message, hint=hint)


def installed_plugins() -> dict[str, Any]:
    """name -> entry point, for every installed plugin."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def _resolve_class(target: Any, name: str) -> type:
    if isinstance(target, type):
        cls = target
    else:
        path = target() if callable(target) else target
        if not isinstance(path, str):
            raise PluginError(f"plugin {name!r}: its entry point returned {type(path).__name__}, "
                              "not a class or a dotted class path")
        module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise PluginError(f"plugin {name!r}: cannot load {path}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, IOProcessor)):
        raise PluginError(f"plugin {name!r}: {cls!r} is not a vbatch IOProcessor subclass")
    return cls


def load_plugin_class(name: str) -> type:
    plugins = installed_plugins()
    if name not in plugins:
        have = ", ".join(sorted(plugins)) or "none"
        raise PluginError(f"no IO processor plugin named {name!r}; installed: {have}",
                          hint=f"install a distribution that registers it in the {GROUP!r} entry-point group")
    try:
        target = plugins[name].load()
    except Exception as e:  # noqa: BLE001  a broken third-party module: say which plugin
        raise PluginError(f"plugin {name!r} does not load: {type(e).__name__}: {e}") from None
    return _resolve_class(target, name)


def select_plugin(explicit: str | None, hf_config: Any = None) -> str | None:
    """The plugin name a run uses: the explicit one, else the model config's `io_processor_plugin`."""
    if explicit:
        return explicit
    from_config = getattr(hf_config, "io_processor_plugin", None) if hf_config is not None else None
    return from_config if isinstance(from_config, str) and from_config else None


def build_plugin(name: str, config: PluginConfig) -> IOProcessor:
    return load_plugin_class(name)(config)
