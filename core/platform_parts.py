"""The vendor module contract: the modules a device platform's plugin class names.

A device platform (``omni.platforms.common.plugin.DevicePlatform``) writes
its hook implementations once over four parts, each a module of the
vendor's package: ``capabilities``, ``attention``, ``gemm`` and, optionally,
``moe``. These Protocols say what each module provides; a module satisfies
one structurally (``isinstance(module, AttentionModule)`` checks the names,
the contract test checks the call shapes too). Arguments are passed
positionally, so a vendor may name them as it likes and add parameters with
defaults (test seams such as ``builders=`` or ``load=``).

``caps`` is the vendor's own capability snapshot, whatever ``detect_caps``
returns (a frozen dataclass in every shipped platform); core never reads
it. ``reject`` is the ``omni.specs.Reject`` of the hook being answered:
a part that declines calls it with a reason prefixed by the platform's name
and returns None.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .specs import (AttentionImpl, AttentionSpec, GemmSpec, GlueImpl, GlueSpec, GroupedGemmImpl, GroupedGemmSpec,
                    LinearImpl, MoEImpl, MoESpec, PlatformInfo, Reject)


@runtime_checkable
class CapabilitiesModule(Protocol):
    """Detection, the capability snapshot and the static refusals of a recipe."""

    def platform_info(self, reject: Reject, /) -> PlatformInfo | None:
        """Say whether the device and the vendor runtime are usable, without a device context.

        When called: by ``omni_platform_detect`` (``omni-run platforms``,
        ``--platform`` selection), in the host process.
        Result: the ``PlatformInfo``, or None after ``reject(reason)``.
        Args: ``reject`` collects the reason shown to the user.
        """

    def detect_caps(self, index: int, /) -> Any:
        """Read the capability snapshot of device ``index``.

        When called: once per plugin instance, lazily, by the first factory
        hook on a worker whose device is set (``omni_platform_configure`` ran).
        Result: the snapshot every ``resolve*`` receives as ``caps``; tests
        build one by hand to describe a device they do not have.
        Args: ``index`` the current device index.
        """

    def recipe_problems(self, recipe: Any, /) -> list[str]:
        """List why this platform cannot run ``recipe`` (empty when it can).

        When called: by ``omni_check_recipe``, once at startup.
        Result: one reason per problem, naming the recipe field.
        Args: ``recipe`` an ``omni.recipe.Recipe`` (frozen).
        """


@runtime_checkable
class AttentionModule(Protocol):
    """The platform's attention kernels."""

    def resolve(self, spec: AttentionSpec, caps: Any, reject: Reject, /) -> AttentionImpl | None:
        """Pick the attention kernel for ``spec``.

        When called: by ``omni_attention_impl``, once per distinct spec at model build.
        Result: an ``AttentionImpl`` as that hook specifies, or None after ``reject``.
        Args: ``caps`` the snapshot of ``detect_caps``.
        """


@runtime_checkable
class GemmModule(Protocol):
    """The platform's dense and grouped GEMMs."""

    def resolve_linear(self, spec: GemmSpec, caps: Any, reject: Reject, /) -> LinearImpl | None:
        """Pick the dense linear for ``spec``.

        When called: by ``omni_linear_impl``, once per distinct spec at model build.
        Result: a ``LinearImpl`` as that hook specifies, or None after ``reject``.
        """

    def resolve_grouped(self, spec: GroupedGemmSpec, caps: Any, reject: Reject, /) -> GroupedGemmImpl | None:
        """Pick the grouped (per-expert) GEMM for ``spec``.

        When called: by ``omni_grouped_gemm_impl``, and by ``omni_moe_impl`` to
        compose a MoE when the platform has no ``moe`` module.
        Result: a ``GroupedGemmImpl`` as that hook specifies, or None after ``reject``.
        """


@runtime_checkable
class MoEModule(Protocol):
    """Optional: a fused MoE kernel (without it the platform's grouped GEMMs are composed)."""

    def resolve_moe(self, spec: MoESpec, caps: Any, reject: Reject, /) -> MoEImpl | None:
        """Pick the fused routed-experts kernel for ``spec``.

        When called: by ``omni_moe_impl``, once per distinct spec at model build.
        Result: a ``MoEImpl`` as that hook specifies, or None after ``reject``.
        """


@runtime_checkable
class GlueModule(Protocol):
    """Optional: fused memory-bound glue between a layer's GEMMs (without it the reference's torch ops run)."""

    def resolve_glue(self, spec: GlueSpec, caps: Any, reject: Reject, /) -> GlueImpl | None:
        """Pick the glue kernels for ``spec``.

        When called: by ``omni_glue_impl``, once per distinct spec at model build.
        Result: a ``GlueImpl`` as that hook specifies, or None after ``reject``.
        """
