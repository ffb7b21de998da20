"""Platform discovery, selection and build-time kernel resolution.

Every platform, the built-in ones included, is found through the
``omni.platforms`` entry-point group and loaded lazily; one whose entry point
fails to load stands in as a ``BrokenPlatform`` (listed with its error, never
selected). Selection yields one ``Platform``: a plugin manager holding the
chosen platform plus the reference (``trylast``). Every hook is a pluggy call,
so hookwrappers and call monitoring registered on ``Platform.pm`` see it.
Kernels are resolved once per spec through it and cached; the objects it
returns are plain callables, so the hot path never sees pluggy.
"""
from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field

import pluggy
import torch

from . import hookspecs
from .hookspecs import hookimpl
from .installed_entry_points import of_group
from .reference import plugin as reference_plugin
from .streams import INLINE, SideStream
from .specs import (AttentionSpec, CaptureSpec, CollectiveSpec, GemmSpec, GlueSpec, GroupedGemmSpec, MoESpec,
                    PlatformInfo, Reject)

log = logging.getLogger("omni.platforms")
ENTRY_POINT_GROUP = "omni.platforms"
REFERENCE = "cpu"
UNATTRIBUTED = "(unattributed)"  # a reason given by a plugin registered on ``Platform.pm`` directly


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


class BrokenPlatform:
    """Stands in for a platform whose entry point failed to load: its detection refuses with the error."""

    def __init__(self, error: Exception):
        self.error = f"import failed: {type(error).__name__}: {error}"

    @hookimpl
    def omni_platform_detect(self, reject) -> None:
        reject(self.error)


def discover(allow: tuple[str, ...] | None = None) -> dict[str, object]:
    """Load every installed platform plugin by entry-point name (``allow`` filters)."""
    found = {}
    for ep in of_group(ENTRY_POINT_GROUP):
        if allow is None or ep.name in allow:
            found[ep.name] = _load(ep)
    found.setdefault(REFERENCE, reference_plugin)
    return found


def _load(ep) -> object:
    """The plugin behind ``ep``, or a ``BrokenPlatform``: one broken package must not take down the others."""
    try:
        return ep.load()
    except Exception as e:  # noqa: BLE001 - whatever a third-party import raises, it is that platform's problem
        log.debug("platform %s failed to load", ep.name, exc_info=True)
        return BrokenPlatform(e)


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
        raise PlatformError(f"--platform auto found no accelerator ({summary}); "
                            "pass --platform cpu to use the reference")
    raise PlatformError(f"--platform auto found several accelerators ({summary}); choose one with --platform")


class _Refusals:
    """The ``reject`` that ``Platform`` passes to a hook: every reason under its plugin's name, and who answered.

    pluggy hands every implementation the same arguments, so a reason cannot say whose it is; the
    ``_Attributed`` adapter a platform plugin is registered through hands its plugin ``by(name)`` instead.
    """

    def __init__(self):
        self.reasons: list[tuple[str, str]] = []
        self.answered_by = UNATTRIBUTED

    def __call__(self, reason: str) -> None:
        self.reasons.append((UNATTRIBUTED, reason))

    def by(self, plugin: str) -> Reject:
        return lambda reason: self.reasons.append((plugin, reason))


class _Attributed:
    """A platform plugin as ``Platform`` registers it: the same hookimpls, with ``reject`` bound to its name.

    pluggy reads a hookimpl's argument names through ``inspect.signature`` (which follows the
    ``__wrapped__`` of ``functools.wraps``) and its options from the function's ``omni_impl`` marker
    (copied with its ``__dict__``), so order (``trylast``), argument checks and other plugins'
    wrappers treat the adapter exactly as the plugin.
    """

    def __init__(self, plugin: object, name: str, pm: pluggy.PluginManager):
        for attr in dir(plugin):
            if pm.parse_hookimpl_opts(plugin, attr) is not None:  # pluggy's own test of what is a hookimpl
                setattr(self, attr, _attributed(getattr(plugin, attr), name))


def _attributed(method, plugin: str):
    """``method`` calling its plugin's ``reject`` as ``refusals.by(plugin)`` and recording an answer."""
    passed = [n for n, p in inspect.signature(method).parameters.items()  # what pluggy passes, in order
              if p.kind <= p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    if "reject" not in passed:
        return method  # nothing to attribute (configure, services, shutdown, ...)
    at = passed.index("reject")

    @functools.wraps(method)
    def call(*args):  # pluggy passes the hook's arguments positionally, in the order of the signature
        refusals = args[at]
        if not isinstance(refusals, _Refusals):  # someone called pm.hook with a plain reject: pass it on
            return method(*args)
        result = method(*args[:at], refusals.by(plugin), *args[at + 1:])
        if result is not None:
            refusals.answered_by = plugin
        return result

    return call


class Platform:
    """The active platform: resolves kernels once per spec and hands out device services.

    Every hook is called through ``self.pm.hook`` (a real pluggy call), so a plugin registered on
    ``pm`` directly (a tracer ``@hookimpl(wrapper=True)``) or ``pm.add_hookcall_monitoring`` sees
    factory calls too. The platform and the reference are registered through ``_Attributed``, which
    is how a refusal, and the trace's answering plugin, is attributed to its plugin.
    """

    def __init__(self, info: PlatformInfo, plugin: object, trace: bool = False):
        self.info, self.name, self.trace = info, info.name, trace
        self.pm = _new_manager()
        if plugin is not reference_plugin:
            self.pm.register(_Attributed(plugin, info.name, self.pm), name=info.name)
        self.pm.register(_Attributed(reference_plugin, REFERENCE, self.pm), name=REFERENCE)
        self.pm.check_pending()
        self._cache: dict[tuple[str, object], object] = {}
        self._side = None

    # -- build-time factories (cached per spec)
    def attention(self, spec: AttentionSpec):
        return self._resolve("omni_attention_impl", spec)

    def linear(self, spec: GemmSpec):
        return self._resolve("omni_linear_impl", spec)

    def grouped_gemm(self, spec: GroupedGemmSpec):
        return self._resolve("omni_grouped_gemm_impl", spec)

    def moe(self, spec: MoESpec):
        return self._resolve("omni_moe_impl", spec)

    def glue(self, spec: GlueSpec):
        return self._resolve("omni_glue_impl", spec)

    def graph_runner(self, spec: CaptureSpec):
        """A fresh runner per region (runners hold their captured graph, so no caching)."""
        return self._call("omni_graph_runner_impl", spec, required=True)

    def communicator(self, spec: CollectiveSpec, group):
        return self._call("omni_communicator_impl", spec, required=False, group=group)

    def _resolve(self, hook: str, spec):
        key = (hook, spec)
        if key not in self._cache:
            self._cache[key] = self._call(hook, spec, required=True)
        return self._cache[key]

    def _call(self, hook: str, spec, required: bool, **extra):
        """One pluggy call of a factory (first answer wins); without an answer, every refusal is the error."""
        refusals = _Refusals()
        result = getattr(self.pm.hook, hook)(spec=spec, reject=refusals, **extra)
        if result is not None:
            self._log(hook, spec, result, refusals)
        elif required:
            raise NoImplementationError(hook.removeprefix("omni_").removesuffix("_impl"), spec, refusals.reasons)
        return result

    def _log(self, hook, spec, result, refusals: _Refusals) -> None:
        if self.trace:
            declined = "".join(f" [{p} declined: {r}]" for p, r in refusals.reasons)
            log.info("%s(%s) -> %s: %s%s", hook, spec, refusals.answered_by,
                     getattr(result, "name", type(result).__name__), declined)

    # -- coarse, non-factory hooks
    def device_services(self, local_rank: int = 0):
        self.pm.hook.omni_platform_configure(info=self.info, local_rank=local_rank)
        services = self.pm.hook.omni_device_services(info=self.info)
        if hasattr(services, "index"):
            services.index = local_rank
        return services

    def side_stream(self):
        """The worker's side stream (``omni.streams.SideStream``, one per platform object), or ``omni.streams.INLINE``
        on a device without streams (the CPU). Called at model build, on the device ``omni_platform_configure``
        bound."""
        if self._side is None:
            services = self.pm.hook.omni_device_services(info=self.info)
            if hasattr(services, "index") and self.info.accelerator:  # the worker's device
                services.index = torch.accelerator.current_device_index()
            side = services.stream()
            self._side = INLINE if side is None else SideStream(services, side)
        return self._side

    def dist_backend(self) -> str:
        return self.pm.hook.omni_dist_backend(info=self.info)

    def shared_device_env(self, rank: int, backend: str) -> dict[str, str]:
        """What a rank sharing its device with other ranks of the job sets before ``init_process_group``."""
        return dict(self.pm.hook.omni_shared_device_env(info=self.info, rank=rank, backend=backend))

    def check_recipe(self, recipe) -> list[str]:
        refusals = _Refusals()  # what the adapters expect as ``reject``; the reasons name their fields
        self.pm.hook.omni_check_recipe(recipe=recipe, info=self.info, reject=refusals)
        return [reason for _, reason in refusals.reasons]

    def plan_patches(self, recipe) -> list:
        return [p for p in self.pm.hook.omni_adjust_plan(recipe=recipe, info=self.info) if p is not None]

    def compile_scope(self):
        """The platform's compile scope (``omni_compile_scope``: a context manager), or None where it has none."""
        return self.pm.hook.omni_compile_scope(info=self.info)

    def shutdown(self) -> None:
        self.pm.hook.omni_platform_shutdown(info=self.info)
