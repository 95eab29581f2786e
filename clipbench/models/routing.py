"""Routing replay for mixture-of-experts models: record which experts each token was routed to, and
make later forwards use those experts (`model.routing_replay`: r2, r3).

    replay = RouteReplay.attach(model)            # hooks every router of the model, once per run
    table = replay.new_table(rows, width)         # (B, layers, width, k) int32, 0 = not recorded
    replay.record(table, rows, cols)              # this micro-batch's forwards write their choices
    replay.replay(table, rows, cols)              # ... or use the recorded ones (forward and recompute)
    replay.off()                                  # the routers choose freely again

A router is transformers' `Qwen3MoeTopKRouter` or `MixtralTopKRouter` (its forward returns the
router logits, the top-k weights and the top-k indices). The hook replaces only the choice: the
weights are gathered from the live router's full softmax (and renormalised as the router does), so
the router keeps its gradient. Tokens without a recorded route (entry 0: e.g. the last token a
sampler generated, which it never fed back) keep the live router's choice.

The hooks stay registered: what they do is the state set by record/replay/off, so an
activation-checkpoint recompute during backward (after the forward returned) replays the same
routes. Routes are indexed by decoder layer (the router's place in the model), row and column of
the rollout batch's packed layout (prompts left-padded to the batch's widest): `cols` is the
micro-batch's window into it. Stored +1 (0: none), so rows recorded on different ranks add up
(each row is recorded by one rank; an all-reduce sum shares them).
"""

from __future__ import annotations

import torch

# router class -> does it renormalise its top-k weights (to sum to 1)?
ROUTERS = {"Qwen3MoeTopKRouter": lambda m: bool(m.norm_topk_prob), "MixtralTopKRouter": lambda m: True}
REPLAY_TYPES = ("qwen3_moe", "mixtral")  # the model types whose routers these are
ATTR = "_clipbench_route_replay"


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers (any `*TopKRouter` module), in module order (= decoder layer order)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def replayable(model: torch.nn.Module) -> str | None:
    """Why routing replay cannot run on `model`, or None."""
    found = routers(model)
    if not found:
        return f"{type(model).__name__} has no top-k router (not a mixture-of-experts model)"
    other = sorted({type(m).__name__ for m in found} - set(ROUTERS))
    if other:
        return f"routing replay knows the routers {', '.join(ROUTERS)}, not {', '.join(other)}"
    return None


class RouteReplay:
    """The record/replay hooks of one model's routers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, replaces: bool = True):
        why = replayable(model)
        if why is not None:
            raise ValueError(why)
        self.replaces = replaces  # False: `replay` only compares the live choice with the table (diagnostics)
        self.routers = routers(model)
        self.top_k = self.routers[0].top_k
        self.mode: str | None = None
        self.table: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.cols = slice(0, 0)
        self.calls: dict[int, list[torch.Tensor]] = {}  # layer -> each call's choice (generate mode)
        self.changed: dict[int, torch.Tensor] = {}  # layer -> (b, w) bool: the live choice is not the replayed one
        self.live: dict[int, torch.Tensor] = {}  # layer -> (b, w, k): the live routers' choice (replay mode)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @classmethod
    def attach(cls, model: torch.nn.Module, *, replaces: bool = True) -> RouteReplay:
        """The model's hooks, registered on first use; `replaces` False: observe only (routing replay
        none: the diagnostics compare the live routes with the old forward's, which nothing replays)."""
        if getattr(model, ATTR, None) is None:
            object.__setattr__(model, ATTR, cls(model, replaces=replaces))
        return getattr(model, ATTR)

    @staticmethod
    def of(model: torch.nn.Module) -> RouteReplay | None:
        return getattr(model, ATTR, None)

    def new_table(self, rows: int, width: int, device=None) -> torch.Tensor:
        """(rows, layers, width, k) int32 zeros: nothing recorded."""
        return torch.zeros(rows, len(self.routers), width, self.top_k, dtype=torch.int32, device=device)

    def record(self, table: torch.Tensor, rows: torch.Tensor, cols: slice) -> None:
        self.mode, self.table, self.rows, self.cols = "record", table, rows, cols

    def replay(self, table: torch.Tensor | None, rows: torch.Tensor | None, cols: slice) -> None:
        if table is None or rows is None:
            return self.off()
        self.mode, self.table, self.rows, self.cols = "replay", table, rows, cols

    def record_generation(self) -> None:
        """Collect every router call's choice, in call order per layer (a generate's prompt pass, then
        one column per step): `generated_routes` assembles them."""
        self.mode, self.calls = "generate", {i: [] for i in range(len(self.routers))}

    def generated_routes(self, rows: int) -> torch.Tensor:
        """(rows, layers, columns, k) int32 +1 of the calls since `record_generation`: the prompt pass's
        columns, then one per generated token fed back (the last sampled token never is)."""
        per_layer = [torch.cat([c.view(rows, -1, c.shape[-1]) for c in self.calls[i]], 1) for i in self.calls]
        self.off()
        return torch.stack(per_layer, 1).to(torch.int32) + 1

    def off(self) -> None:
        self.mode, self.table, self.rows = None, None, None
        self.changed, self.live = {}, {}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _window(self, layer: int) -> torch.Tensor:
        return self.table[self.rows, layer, self.cols]  # (b, w, k)

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self.mode is None:
                return None
            logits, weights, chosen = output  # (n, E), (n, k), (n, k)
            if self.mode == "generate":
                self.calls[layer].append(chosen.detach().cpu())
                return None
            b, w = self.rows.numel(), self.cols.stop - self.cols.start
            if self.mode == "record":
                self.table[self.rows, layer, self.cols] = chosen.reshape(b, w, -1).to(torch.int32) + 1
                return None
            recorded = self._window(layer).reshape(b * w, -1).to(chosen.dtype) - 1  # (n, k), -1: none
            moved = (recorded.sort(-1).values != chosen.sort(-1).values).any(-1) & (recorded >= 0).all(-1)
            self.changed[layer] = moved.view(b, w)  # as a set of k experts
            self.live[layer] = chosen.view(b, w, -1)
            if not self.replaces:
                return None
            chosen = torch.where(recorded >= 0, recorded, chosen)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # the live router's softmax
            top = probs.gather(-1, chosen)
            if ROUTERS[type(module).__name__](module):
                top /= top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), chosen

        return hook


def moved_tokens(replay: RouteReplay, mb, active: bool) -> torch.Tensor:
    """(layers, b, T) bool over the completion tokens of micro-batch `mb` just replayed: the live
    routers chose another set of experts than the replayed ones, each token's experts taken at the
    position that predicts it (the prompt's last token for the first). All False for a micro-batch
    that was not replayed (`active` False: a placeholder). Padding is not masked here."""
    b, T = mb.completion_mask.shape
    layers = len(replay.routers)
    if not active or len(replay.changed) < layers:
        return torch.zeros(layers, b, T, dtype=torch.bool, device=mb.completion_mask.device)
    start = mb.input_ids.shape[1] - T - 1  # the column predicting token 0
    return torch.stack([replay.changed[i][:, start : start + T] for i in range(layers)])


def load_sums(replay: RouteReplay, mb, active: bool) -> dict[str, torch.Tensor]:
    """`routing/load/l<i>/e<j>`: the top-k assignments of the live routers to expert j in layer i
    over the micro-batch's valid completion tokens (at the positions predicting them); zeros for a
    micro-batch that was not replayed."""
    mask = mb.completion_mask > 0  # (b, T)
    b, T = mask.shape
    layers, experts = len(replay.routers), replay.routers[0].num_experts
    counts = torch.zeros(layers, experts, dtype=torch.float64, device=mask.device)
    if active and len(replay.live) == layers:
        start = mb.input_ids.shape[1] - T - 1
        for i in range(layers):  # one-hot sums, not bincount or a boolean index: no host sync
            chosen = torch.nn.functional.one_hot(replay.live[i][:, start : start + T].long(), experts)  # (b, T, k, E)
            counts[i] = (chosen * mask[:, :, None, None]).sum((0, 1, 2)).double()
    return {f"routing/load/l{i}/e{j}": counts[i, j] for i in range(layers) for j in range(experts)}


def agreement_sums(moved: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """`routing/tokens` (valid completion tokens), `routing/changed` (those with a moved layer) and
    `routing/changed/l<i>` per decoder layer; moved: (layers, b, T) bool, mask: (b, T)."""
    valid = mask > 0
    per_layer = moved & valid
    out = {"routing/tokens": valid.sum().double(), "routing/changed": per_layer.any(0).sum().double()}
    out.update({f"routing/changed/l{i}": c.sum().double() for i, c in enumerate(per_layer)})
    return out


def agreement_metrics(reduced: dict) -> dict[str, float]:
    """The logged routing agreement of one optimizer step from its reduced `agreement_sums`."""
    n = max(float(reduced["routing/tokens"]), 1.0)
    out = {"routing/changed_frac": float(reduced["routing/changed"]) / n}
    layers = sorted(int(k.rsplit("/l", 1)[1]) for k in reduced if k.startswith("routing/changed/l"))
    out.update({f"routing/agree/l{i}": 1.0 - float(reduced[f"routing/changed/l{i}"]) / n for i in layers})
    load = {}
    for k, v in reduced.items():
        if k.startswith("routing/load/l"):
            layer, expert = k[len("routing/load/l") :].split("/e")
            load.setdefault(int(layer), {})[int(expert)] = float(v)
    for i, per_expert in sorted(load.items()):  # max violation: the busiest expert's load over the mean load, - 1
        mean = sum(per_expert.values()) / len(per_expert)
        out[f"routing/load_maxvio/l{i}"] = max(per_expert.values()) / mean - 1.0 if mean > 0 else 0.0
    if load:
        out["routing/load_maxvio"] = max(out[f"routing/load_maxvio/l{i}"] for i in load)
    return out


def row_routes_table(routes: list[torch.Tensor], prompt_lens: list[int], width: int, prompt_width: int) -> torch.Tensor:
    """(B, layers, width, k) route table of a packed batch from each row's own routes (layers, prompt
    + completion columns, k) (+1; 0: none): row i's columns start at prompt_width - prompt_lens[i]."""
    first = routes[0]
    table = torch.zeros(len(routes), first.shape[0], width, first.shape[-1], dtype=torch.int32)
    for i, (r, lp) in enumerate(zip(routes, prompt_lens)):
        start = prompt_width - lp
        n = min(r.shape[1], width - start)
        table[i, :, start : start + n] = r[:, :n]
    return table


def micro_columns(batch, mb) -> slice:
    """The columns of packed micro-batch `mb` in its rollout batch `batch` (train/packing.py's layout:
    prompts left-padded to the batch's widest prompt, then completions)."""
    full_prompt = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
    mb_prompt = mb.input_ids.shape[1] - mb.completion_ids.shape[1]
    start = full_prompt - mb_prompt
    return slice(start, start + mb.input_ids.shape[1])
