"""Kernel classes found lazily: built-ins by module path, plugins by entry point. Shared by the
attention and the quantized-matmul registries, so a missing optional kernel (Triton, IPEX, a
SYCL plugin) never breaks `import tpserve` and a broken one is a reason, not a crash."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points

from tpserve.errors import KernelUnavailableError


@dataclass(frozen=True)
class LazyClasses:
    what: str  # "attention backend", "quantized-matmul kernel": for messages
    group: str  # entry-point group of plugins
    builtin: dict[str, str]  # name -> "module:Class", in --kernel auto preference order
    base: type  # every class must subclass it

    def plugins(self) -> dict[str, object]:
        return {ep.name: ep for ep in entry_points(group=self.group)}

    def names(self) -> list[str]:
        return list(self.builtin) + [n for n in self.plugins() if n not in self.builtin]

    def origin(self, name: str) -> str:
        """Where a class comes from: "built-in" or the plugin's entry point."""
        if name in self.builtin:
            return "built-in"
        ep = self.plugins().get(name)
        return f"plugin {ep.value}" if ep is not None else "unknown"

    def load(self, name: str) -> type:
        """Import one class; raises KernelUnavailableError naming what failed."""
        try:
            if name in self.builtin:
                module, _, attr = self.builtin[name].partition(":")
                cls = getattr(importlib.import_module(module), attr)
            else:
                plugins = self.plugins()
                if name not in plugins:
                    raise KernelUnavailableError(
                        f"unknown {self.what} {name!r}; known: {', '.join(self.names())}")
                cls = plugins[name].load()
        except KernelUnavailableError:
            raise
        except Exception as exc:  # noqa: BLE001 - an optional kernel failing to import
            raise KernelUnavailableError(
                f"{name}: cannot import ({type(exc).__name__}: {exc})") from exc
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            article = "an" if self.base.__name__[0] in "AEIOU" else "a"
            raise KernelUnavailableError(
                f"{name}: {cls!r} is not {article} {self.base.__name__} subclass")
        return cls
