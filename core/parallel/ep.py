"""Expert parallelism: a routed-experts module that holds experts ``[e0, e1)`` of ``E``.

The module itself is the model's own (built with ``E / groups`` experts,
names unchanged); ``ExpertShard`` attaches a forward pre-hook and a forward
hook to it, as ``torch.distributed.tensor.parallel`` styles do. The module's
contract is ``module(x_TD, weights_Tk, experts_Tk) -> y_TD`` where the
output is already weighted by ``weights`` and summed over the k choices;
fed one (token, expert) assignment per row (k = 1) it returns one weighted
row per assignment, which is what both modes below rely on. Its ``topk``
attribute is the k it is fed: the shard sets it to 1, so the MoE kernel the
module builds from it at ``finalize()`` knows (the cuda platform compiles the
sort's k = 1 launches at build instead of in a request):

- select (tokens replicated over the ep group, ``dispatch == 1``): keep the
  assignments that route to local experts, run them, and add the rows back
  per token. Other ranks add theirs; the tp all-reduce after the MoE sums.
- dispatch (tokens differ across the group): sort assignments by the rank
  owning their expert, exchange counts, then rows, weights and local expert
  ids with ``all_to_all_single`` (gloo and NCCL both have it); run the
  received rows; send the weighted rows back with the reverse all-to-all and
  add them per token.

Both read counts on the host (``nonzero`` / ``tolist``), so an EP MoE is not
capturable into a device graph as written.

Shape suffixes: T tokens, D width, k choices per token, R assignments (T*k).
"""
from __future__ import annotations

import torch

from omni.specs import RowQuantized


class ExpertShard:
    """Hooks that route tokens to the experts this rank holds (see the module docstring)."""

    def __init__(self, experts: range, num_experts: int, comm):
        self.experts, self.num_experts, self.comm = experts, num_experts, comm
        self.per_rank = len(experts)
        self._pending = None

    def attach(self, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(self.before)
        module.register_forward_hook(self.after)
        module.topk = 1  # the k it is fed from now on: one (token, expert) assignment a row

    # ------------------------------------------------------------------ hooks

    def before(self, module, args):
        x_TD, w_Tk, e_Tk = args
        if isinstance(x_TD, RowQuantized):  # rows a glue kernel quantized: route the rows, the kernel requantizes
            x_TD = x_TD.x_TI
        if self.comm.size == 1:
            return self._select(x_TD, w_Tk, e_Tk)
        return self._dispatch(x_TD, w_Tk, e_Tk)

    def after(self, module, args, y):
        token_R, T, back = self._pending
        self._pending = None
        if back is not None:
            y = self.comm.all_to_all(y, *back)
        out_TD = torch.zeros(T, y.shape[-1], dtype=torch.float32, device=y.device)
        return out_TD.index_add_(0, token_R, y.float()).to(y.dtype)

    # ------------------------------------------------------------------ modes

    def _select(self, x_TD, w_Tk, e_Tk):
        e0 = self.experts.start
        keep_Tk = (e_Tk >= e0) & (e_Tk < self.experts.stop)
        token_R, choice_R = keep_Tk.nonzero(as_tuple=True)
        self._pending = (token_R, x_TD.shape[0], None)
        return x_TD[token_R], w_Tk[token_R, choice_R][:, None], (e_Tk[token_R, choice_R] - e0)[:, None]

    def _dispatch(self, x_TD, w_Tk, e_Tk):
        T, k = e_Tk.shape
        m = self.comm.size
        expert_R, weight_R = e_Tk.flatten(), w_Tk.flatten()
        dest_R = torch.div(expert_R, self.per_rank, rounding_mode="floor")
        order_R = dest_R.argsort(stable=True)
        token_R = torch.div(order_R, k, rounding_mode="floor")
        counts_m = torch.bincount(dest_R, minlength=m)
        recv_m = self.comm.all_to_all(counts_m, [1] * m, [1] * m)
        send, recv = counts_m.tolist(), recv_m.tolist()
        local_R = expert_R[order_R] - dest_R[order_R] * self.per_rank
        x_in = self.comm.all_to_all(x_TD[token_R], send, recv)
        w_in = self.comm.all_to_all(weight_R[order_R].contiguous(), send, recv)
        e_in = self.comm.all_to_all(local_R.contiguous(), send, recv)
        self._pending = (token_R, T, (recv, send))
        return x_in, w_in[:, None], e_in[:, None]
