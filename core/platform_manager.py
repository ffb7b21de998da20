"""Platform discovery, selection and build-time kernel resolution.

Every platform, the built-in ones included, is found through the
``omni.platforms`` entry-point group and loaded lazily. Selection yields one
``Platform``: a plugin manager holding the chosen platform plus the reference
(``trylast``). Kernels are resolved once per spec through it and cached; the
objects it returns are plain callables, so the hot path never sees pluggy.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pluggy

from . import hookspecs
from .reference import plugin as reference_plugin
from .specs import AttentionSpec, CaptureSpec, CollectiveSpec, GemmSpec, GroupedGemmSpec, MoESpec, PlatformInfo

log = logging.getLogger("omni.platforms")
ENTRY_POINT_GROUP = "omni.platforms"
REFERENCE = "cpu"


class PlatformError(RuntimeError):
    """A platform could not be selected or could not serve a request; the message says why."""


class NoImplementationError(PlatformError):
    def __init__(self, what: str, spec: object, reasons: list[tuple[str, str]]):
        lines = [f"no platform plugin implements {what} for {spec}:"]
        lines += [f"  - {plugin}: {reason}" for plugin, reason in reasons] or ["  (no plugin implements this hook)"]
        super().__init__("\n".join(lines))
        self.reasons = reasons


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def discover(allow: tuple[str, ...] | None = None) -> dict[str, object]:
    """Load every installed platform plugin by entry-point name (``allow`` filters)."""
    found = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if allow is None or ep.name in allow:
            found[ep.name] = ep.load()
    found.setdefault(REFERENCE, reference_plugin)
    return found


@dataclass
class Detection:
    name: str
    info: PlatformInfo | None
    reasons: list[str] = field(default_factory=list)


def detect(name: str, plugin: object) -> Detection:
    """Run one platform's cheap detection on its own."""
    pm = _new_manager()
    pm.register(plugin, name=name)
    pm.check_pending()
    reasons: list[str] = []
    infos = pm.hook.omni_platform_detect(reject=reasons.append)
    return Detection(name, infos[0] if infos else None, reasons)


def detect_all(allow: tuple[str, ...] | None = None) -> list[Detection]:
    return [detect(n, p) for n, p in sorted(discover(allow).items())]


def select(name: str = "auto", allow: tuple[str, ...] | None = None, trace: bool = False) -> "Platform":
    """Pick the platform ``name`` or, for ``auto``, the single accelerator present."""
    plugins = discover(allow)
    if name == "auto":
        return _select_auto(plugins, trace)
    if name not in plugins:
        raise PlatformError(f"unknown platform {name!r}; installed: {', '.join(sorted(plugins))}")
    det = detect(name, plugins[name])
    if det.info is None:
        raise PlatformError(f"platform {name!r} is not usable here: " + "; ".join(det.reasons or ["no reason given"]))
    return Platform(det.info, plugins[name], trace=trace)


def _select_auto(plugins: dict[str, object], trace: bool) -> "Platform":
    dets = [detect(n, p) for n, p in sorted(plugins.items()) if n != REFERENCE]
    present = [d for d in dets if d.info is not None and d.info.accelerator]
    if len(present) == 1:
        return Platform(present[0].info, plugins[present[0].name], trace=trace)
    summary = "; ".join(f"{d.name}: {'present' if d.info else ', '.join(d.reasons) or 'absent'}" for d in dets)
    if not present:
        raise PlatformError(f"--platform auto found no accelerator ({summary}); pass --platform cpu to use the reference")
    raise PlatformError(f"--platform auto found several accelerators ({summary}); choose one with --platform")


class Platform:
    """The active platform: resolves kernels once per spec and hands out device services."""

    def __init__(self, info: PlatformInfo, plugin: object, trace: bool = False):
        self.info, self.name, self.trace = info, info.name, trace
        self.pm = _new_manager()
        if plugin is not reference_plugin:
            self.pm.register(plugin, name=info.name)
        self.pm.register(reference_plugin, name=REFERENCE)
        self.pm.check_pending()
        self._cache: dict[tuple[str, object], object] = {}

    # -- build-time factories (cached per spec)
    def attention(self, spec: AttentionSpec):
        return self._resolve("omni_attention_impl", spec)

    def linear(self, spec: GemmSpec):
        return self._resolve("omni_linear_impl", spec)

    def grouped_gemm(self, spec: GroupedGemmSpec):
        return self._resolve("omni_grouped_gemm_impl", spec)

    def moe(self, spec: MoESpec):
        return self._resolve("omni_moe_impl", spec)

    def graph_runner(self, spec: CaptureSpec):
        """A fresh runner per region (runners hold their captured graph, so no caching)."""
        return self._first("omni_graph_runner_impl", spec, required=True)

    def communicator(self, spec: CollectiveSpec, group):
        return self._first("omni_communicator_impl", spec, required=False, group=group)

    def _resolve(self, hook: str, spec):
        key = (hook, spec)
        if key not in self._cache:
            self._cache[key] = self._first(hook, spec, required=True)
        return self._cache[key]

    def _first(self, hook: str, spec, required: bool, **extra):
        """Call implementations in pluggy order, attributing refusals to their plugin."""
        reasons: list[tuple[str, str]] = []
        for impl in reversed(getattr(self.pm.hook, hook).get_hookimpls()):
            kwargs = {"spec": spec, "reject": lambda r, p=impl.plugin_name: reasons.append((p, r)), **extra}
            result = impl.function(*[kwargs[a] for a in impl.argnames])
            if result is not None:
                self._log(hook, spec, impl.plugin_name, result, reasons)
                return result
        if required:
            raise NoImplementationError(hook.removeprefix("omni_").removesuffix("_impl"), spec, reasons)
        return None

    def _log(self, hook, spec, plugin, result, reasons) -> None:
        if self.trace:
            declined = "".join(f" [{p} declined: {r}]" for p, r in reasons)
            log.info("%s(%s) -> %s: %s%s", hook, spec, plugin, getattr(result, "name", type(result).__name__), declined)

    # -- coarse, non-factory hooks
    def device_services(self, local_rank: int = 0):
        self.pm.hook.omni_platform_configure(info=self.info, local_rank=local_rank)
        services = self.pm.hook.omni_device_services(info=self.info)
        if hasattr(services, "index"):
            services.index = local_rank
        return services

    def dist_backend(self) -> str:
        return self.pm.hook.omni_dist_backend(info=self.info)

    def check_recipe(self, recipe) -> list[str]:
        reasons: list[str] = []
        self.pm.hook.omni_check_recipe(recipe=recipe, info=self.info, reject=reasons.append)
        return reasons

    def plan_patches(self, recipe) -> list:
        return [p for p in self.pm.hook.omni_adjust_plan(recipe=recipe, info=self.info) if p is not None]

    def shutdown(self) -> None:
        self.pm.hook.omni_platform_shutdown(info=self.info)
