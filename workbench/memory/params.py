"""Which parameter tensors each rank holds: pipeline stage split, then tensor-parallel split.

Pure Python from a ModelShape (no torch): the same tensors `workbench.models.GPT` creates,
with the dimension tensor parallelism cuts (column-parallel: dim 0, row-parallel: dim 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from workbench.parallelism import looped_stages

# How the runtime's TP plan cuts each block tensor: "col" shards dim 0 (output features),
# "row" shards dim 1 (input features), None is replicated. A column-parallel bias shards with its
# output dimension; a row-parallel bias is added after the reduction, so it stays whole.
# (name, dims, split, which bias flag keeps it: None = always there)
_BLOCK = (
    ("attn_norm.weight", "h", None, None), ("attn_norm.bias", "h", None, "gpt"),
    ("attn.wq.weight", "h,h", "col", None), ("attn.wq.bias", "h", "col", "qkv_bias"),
    ("attn.wk.weight", "kv,h", "col", None), ("attn.wk.bias", "kv", "col", "qkv_bias"),
    ("attn.wv.weight", "kv,h", "col", None), ("attn.wv.bias", "kv", "col", "qkv_bias"),
    ("attn.wo.weight", "h,h", "row", None), ("attn.wo.bias", "h", None, "out_bias"),
    ("mlp_norm.weight", "h", None, None), ("mlp_norm.bias", "h", None, "gpt"),
    ("mlp.w1.weight", "f,h", "col", None), ("mlp.w1.bias", "f", "col", "mlp_bias"),
    ("mlp.w2.weight", "h,f", "row", None), ("mlp.w2.bias", "h", None, "mlp_bias"),
    ("mlp.w3.weight", "f,h", "col", "llama"), ("mlp.w3.bias", "f", "col", "llama+mlp_bias"),
)


@lru_cache(maxsize=256)
def _block_table(shape) -> tuple[tuple[str, str, str | None], ...]:
    """The block's tensors in `workbench.models.Block`'s parameter order for this shape."""
    def present(flag: str | None) -> bool:
        if flag is None:
            return True
        return all(getattr(shape, f) if f.endswith("bias") else shape.family == f for f in flag.split("+"))

    return tuple((n, d, s) for n, d, s, flag in _BLOCK if present(flag))


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # the local shape on one tp rank


def _dims(spec: str, shape) -> tuple[int, ...]:
    table = {"h": shape.hidden, "kv": shape.kv_dim, "f": shape.ffn_hidden, "v": shape.padded_vocab,
             "s": shape.max_positions}
    return tuple(table[d] for d in spec.split(","))


def _local(dims: tuple[int, ...], split: str | None, tp: int) -> tuple[int, ...]:
    if split == "col":
        return (dims[0] // tp,) + dims[1:]
    if split == "row":
        return (dims[0], dims[1] // tp)
    return dims


@lru_cache(maxsize=1024)
def stage_blocks(shape, num_stages: int) -> tuple[range, ...]:
    """Blocks of each (virtual) pipeline stage, as the runtime splits them (parallel/pp.py):
    contiguous ranges minimizing the largest stage's parameter count, the embedding counted on
    the first stage and the final norm + head on the last."""
    block = sum(numel(t) for t in block_tensors(shape, 1))
    first = sum(numel(t) for t in embedding_tensors(shape, 1))
    last = sum(numel(t) for t in final_tensors(shape, 1, head_copy=True))
    if shape.layers <= 256 or num_stages > shape.layers:
        return balance_blocks((block,) * shape.layers, first, last, num_stages)
    return balance_uniform(shape.layers, block, first, last, num_stages)


def balance_uniform(n: int, block: int, first_extra: int, last_extra: int, num_stages: int) -> tuple[range, ...]:
    """`balance_blocks` for n equal blocks, the same answer without a value per block: O(S log n
    log P) instead of O(S n log n) time and O(S n) memory, so 65,536 layers plan in milliseconds.

    It replays balance_blocks' cut search, reading best[s][i] (the min-max cost of blocks [0, i)
    over stages 0..s) from its closed form: the least M at which the stages' capacities (how many
    blocks fit under M beside each stage's extra) add up to i. Equal to balance_blocks for every
    input (tests/unit/test_bounds.py checks it property by property)."""
    S, b = num_stages, block

    def extra(s: int) -> int:
        return (first_extra if s == 0 else 0) + (last_extra if s == S - 1 else 0)

    def cost(s: int, i: int, j: int) -> int:
        return b * (j - i) + extra(s)

    def best(s: int, i: int) -> int:  # stages 0..s over blocks [0, i), i >= s + 1
        if s == 0:
            return cost(0, 0, i)
        e_last = last_extra if s == S - 1 else 0

        def fits(m: int) -> bool:
            return (m - first_extra) // b + (s - 1) * (m // b) + (m - e_last) // b >= i

        # the max is at least the mean; capacities lose under one block per stage to rounding
        total, k = b * i + first_extra + e_last, s + 1
        lo = max(first_extra, e_last) + b
        lo, hi = max(lo, -(-total // k)), max(lo, -(-(total + b * k) // k))
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def cut(s: int, j: int) -> int:
        lo, hi = s, j
        while lo < hi:
            mid = (lo + hi) // 2
            if best(s - 1, mid) >= cost(s, mid, j):
                hi = mid
            else:
                lo = mid + 1
        chosen, value = 0, None
        for i in (lo - 1, lo):
            if s <= i < j:
                c = max(best(s - 1, i), cost(s, i, j))
                if value is None or c < value:
                    chosen, value = i, c
        return chosen

    bounds, j = [], n
    for s in range(S - 1, 0, -1):
        i = cut(s, j)
        bounds.append(range(i, j))
        j = i
    bounds.append(range(0, j))
    return tuple(bounds[::-1])


def balance_blocks(block_params: tuple[int, ...], first_extra: int, last_extra: int, num_stages: int) -> tuple[range, ...]:
    """Exact min-max contiguous split, the same answer (ties: earliest cut) as the runtime's
    O(S n^2) dynamic programme in O(S n log n): for stage s ending at block j, the best previous
    cut i minimizes max(best[s-1][i], cost(i, j)), a nondecreasing and a strictly decreasing
    function of i, so only the two cuts around their crossing can win."""
    n = len(block_params)
    prefix = [0]
    for p in block_params:
        prefix.append(prefix[-1] + p)

    def cost(s: int, i: int, j: int) -> int:
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0) + (last_extra if s == num_stages - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, num_stages):
        prev = best[s - 1]
        for j in range(s + 1, n + 1):
            lo, hi = s, j  # first i in [s, j) with prev[i] >= cost(s, i, j); j if none
            while lo < hi:
                mid = (lo + hi) // 2
                if prev[mid] >= cost(s, mid, j):
                    hi = mid
                else:
                    lo = mid + 1
            for i in (lo - 1, lo):
                if s <= i < j:
                    c = max(prev[i], cost(s, i, j))
                    if c < best[s][j]:
                        best[s][j], cut[s][j] = c, i
    bounds, j = [], n
    for s in range(num_stages - 1, 0, -1):
        i = cut[s][j]
        bounds.append(range(i, j))
        j = i
    bounds.append(range(0, j))
    return tuple(bounds[::-1])


def block_tensors(shape, tp: int, prefix: str = "") -> list[Tensor]:
    return [Tensor(prefix + n, _local(_dims(d, shape), s, tp)) for n, d, s in _block_table(shape)]


def embedding_tensors(shape, tp: int) -> list[Tensor]:
    # Vocabulary-parallel embedding (rows, padding included, split over tp); learned positions stay whole.
    v = shape.padded_vocab
    out = [Tensor("tok_emb.weight", (v // tp if v % tp == 0 else v, shape.hidden))]
    if shape.family == "gpt":
        out.append(Tensor("pos_emb.weight", (shape.max_positions, shape.hidden)))
    return out


def final_tensors(shape, tp: int, head_copy: bool = False) -> list[Tensor]:
    """The final norm and the head. A tied head is the embedding's weight, counted once with the
    embedding, unless `head_copy`: a last pipeline stage holds a copy of it (parallel/tied.py)."""
    norm = [Tensor("norm.weight", (shape.hidden,))]
    if shape.family == "gpt":
        norm.append(Tensor("norm.bias", (shape.hidden,)))
    if shape.tie_embeddings and not head_copy:
        return norm
    v = shape.padded_vocab
    vocab_local = v // tp if v % tp == 0 else v
    return norm + [Tensor("head.weight", (vocab_local, shape.hidden))]


@lru_cache(maxsize=4096)
def rank_tensors(shape, tp: int, pp: int, pp_index: int, virtual_stages: int = 1) -> tuple[Tensor, ...]:
    """The parameter tensors one (pp_index, any tp rank) holds, with their local shapes.

    With interleaving, pipeline rank r holds virtual stages r, r + pp, r + 2 pp, ...
    """
    num_stages = pp * virtual_stages
    blocks = stage_blocks(shape, num_stages)
    out: list[Tensor] = []
    for stage in looped_stages(pp_index, pp, virtual_stages):
        if stage == 0:
            out += embedding_tensors(shape, tp)
        for b in blocks[stage]:
            out += block_tensors(shape, tp, prefix=f"blocks.{b}.")
        if stage == num_stages - 1:
            out += final_tensors(shape, tp, head_copy=num_stages > 1)
    return tuple(out)


def numel(t: Tensor) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


def rank_params(shape, tp: int, pp: int, pp_index: int, virtual_stages: int = 1) -> int:
    """Parameter count on one rank of pipeline stage `pp_index` (before any ZeRO sharding)."""
    return rank_counts(shape, tp, pp, pp_index, virtual_stages)[0]


@lru_cache(maxsize=4096)
def rank_counts(shape, tp: int, pp: int, pp_index: int, virtual_stages: int = 1, dp: int = 1) -> tuple[int, int, int]:
    """What `rank_tensors` sums to, without a Python object per block (a model may have 65,536):
    (elements, elements of its FSDP2 shard over dp, number of tensors)."""
    num_stages = pp * virtual_stages
    blocks = stage_blocks(shape, num_stages)
    block = block_tensors(shape, tp)
    edge: list[Tensor] = []
    n_blocks = 0
    for stage in looped_stages(pp_index, pp, virtual_stages):
        if stage == 0:
            edge += embedding_tensors(shape, tp)
        n_blocks += len(blocks[stage])
        if stage == num_stages - 1:
            edge += final_tensors(shape, tp, head_copy=num_stages > 1)
    return (sum(numel(t) for t in edge) + n_blocks * sum(numel(t) for t in block),
            fsdp_shard_numel(edge, dp) + n_blocks * fsdp_shard_numel(block, dp),
            len(edge) + n_blocks * len(block))


def fsdp_shard_numel(tensors, n: int) -> int:
    """Elements one rank keeps under FSDP2: each tensor split on dim 0 into n padded chunks."""
    total = 0
    for t in tensors:
        rest = numel(t) // t.shape[0] if t.shape[0] else 0
        total += -(-t.shape[0] // n) * rest
    return total


@lru_cache(maxsize=1024)
def block_numel(shape, tp: int) -> int:
    """Elements of one transformer block's parameters on a rank of a tp group."""
    return sum(numel(t) for t in block_tensors(shape, tp))


def unit_blocks(block_elements: int, unit_mb: float | None) -> int:
    """Blocks per FSDP2 unit (Parallelism.fsdp_unit_mb): as many blocks of `block_elements` as fit
    `unit_mb` MiB of fp32 gradient, at least one; one for None. The runtime's grouping
    (parallel/zero.py `fsdp_units`) gives the same count for equal blocks."""
    if unit_mb is None or block_elements <= 0:
        return 1
    return max(1, int(unit_mb * 2**20 // (4 * block_elements)))


def whole_unit(stage_elements: float, unit_mb: float | None) -> bool:
    """A stage module whose whole fp32 gradient fits `unit_mb` MiB is one FSDP2 unit, its root
    (parallel/zero.py `apply_fsdp`): gathered once per micro-batch and kept to the end of backward."""
    return unit_mb is not None and 4 * stage_elements <= unit_mb * 2**20


@lru_cache(maxsize=1024)
def largest_unit_numel(shape, tp: int, unit_mb: float | None = None, stage_blocks: int | None = None) -> int:
    """Elements of the largest unit FSDP gathers at once: `unit_blocks` blocks (no more than the
    stage's `stage_blocks`), or the embedding/head."""
    block = block_numel(shape, tp)
    k = unit_blocks(block, unit_mb)
    if stage_blocks is not None:
        k = max(1, min(k, stage_blocks))
    return max(k * block, sum(numel(t) for t in embedding_tensors(shape, tp)))
