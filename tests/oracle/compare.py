"""The oracle's comparisons and their tolerances: the ranks' results against the reference.

It compares the losses, the full reduced gradients of every step (before clipping and Adam, which
would hide a uniform error in gradient size: Adam's first steps are close to lr x sign(g)); a
later step's at the parameters the ranks made it at (`Reference.grads_at`: float noise, which Adam
amplifies in near-zero gradients, leaves the two sides' parameters apart by more than a
gradient's rtol can absorb), the clipping coefficient where the ranks can see it (ZeRO-0), and
the parameters after the last step, each tensor relative to the size of its own update.
`assert_split_work`: sequence parallelism really split the work.

Callers import it through `tests/oracle/`.
"""

from __future__ import annotations

import pytest
import torch

from tests.oracle.reference import Reference

# Gradients agree to rtol, plus an atol of this fraction of the largest gradient of the model:
# gradients that are zero in exact arithmetic (a key bias cannot change a softmax) hold only float
# noise of reduction order, ~1e-11 here.
GRAD_RTOL, GRAD_ATOL_FRAC = 1e-4, 1e-6
# A parameter tensor agrees to this fraction of its own update (final - init, its largest
# element): Adam normalises each element's step, so reduction-order noise in a gradient moves
# the step by about the gradient's relative error (1e-4 above), not more. A tensor whose
# gradient is zero in exact arithmetic (a key bias) moves by Adam's step of noise alone (~1e-9
# here, lr x noise / eps, up to 1e-8 seen): it is held to 1e-4 of the model's largest update.
PARAM_UPDATE_FRAC, PARAM_NOISE_FRAC, PARAM_RTOL = 1e-3, 1e-4, 1e-6


def assert_matches(ref: Reference, got: dict, where: str) -> None:
    """`got` (one rank's losses, every step's gradients and final parameters, or every stage's
    together: `merge_stages`) equals the reference."""
    assert got["losses"] == pytest.approx(ref.losses, rel=1e-6, abs=1e-7), (
        f"{where}: losses {got['losses']}, the reference's {ref.losses}")
    assert len(got["grads"]) == len(ref.grads) == len(got["step_params"]) + 1, where
    for step, have in enumerate(got["grads"]):
        # step 0 at the shared init; later steps at the parameters the ranks trained them at:
        # the two sides' parameters differ by float noise (which Adam amplifies in near-zero
        # gradients) and a gradient made at other parameters can differ by far more than its rtol
        want = ref.grads[0] if step == 0 else ref.grads_at(step, got["step_params"][step - 1])
        assert_grads_match(want, have, f"{where} step {step}")
    for coefs in got.get("stage_clip_coefs") or [got.get("clip_coefs") or []]:
        for step, (want, have) in enumerate(zip(ref.clip_coefs(), coefs or [])):
            assert have == pytest.approx(want, rel=1e-5), \
                f"{where} step {step}: the gradients were clipped by {have}, the reference " \
                f"by {want}"
    assert_params_match(ref, got["params"], where)


def assert_params_match(ref: Reference, got: dict, where: str) -> None:
    """Every parameter tensor equals the reference's to PARAM_UPDATE_FRAC of its own update (or
    PARAM_NOISE_FRAC of the model's largest, if more)."""
    assert got.keys() == ref.params.keys(), where
    updates = {k: float((want - ref.init[k]).abs().max()) for k, want in ref.params.items()}
    noise = PARAM_NOISE_FRAC * max(updates.values())
    for key, want in ref.params.items():
        update = updates[key]
        torch.testing.assert_close(got[key], want, rtol=PARAM_RTOL,
                                   atol=max(PARAM_UPDATE_FRAC * update, noise),
                                   msg=lambda m: f"{where} param {key} (update {update:.2e}): {m}")


def merge_stages(stages: list[dict]) -> dict:
    """One result of pipeline stages' results (data-parallel rank 0 of each, in stage order):
    the last stage's losses, each step's gradients and the parameters it was made at, the final
    parameters of all stages (an encoder replica's, under "uniform", the last stage's copy), and
    each stage's clip coefficients (each stage clips its own gradients by the pipeline's one
    norm)."""
    steps = len(stages[0]["grads"])
    return {"losses": stages[-1]["losses"],
            "grads": [{k: g for r in stages for k, g in r["grads"][s].items()}
                      for s in range(steps)],
            "step_params": [{k: p for r in stages for k, p in r["step_params"][s].items()}
                            for s in range(steps - 1)],
            "params": {k: p for r in stages for k, p in r["params"].items()},
            "stage_clip_coefs": [r.get("clip_coefs") for r in stages]}


def assert_grads_match(want: dict, got: dict, where: str) -> None:
    nonzero = {k for k, g in want.items() if g.any()}
    assert nonzero, where
    missing = sorted(nonzero - set(got))
    assert not missing, f"{where}: no gradient for {missing[:5]}"
    atol = GRAD_ATOL_FRAC * max(float(want[k].abs().max()) for k in nonzero)
    for key in nonzero:
        torch.testing.assert_close(got[key], want[key], rtol=GRAD_RTOL, atol=atol,
                                   msg=lambda m: f"{where} grad of {key}: {m}")


def assert_moved(ref: Reference, where: str, with_grad: float = 0.7) -> None:
    """The comparison is not between two untouched inits: more than `with_grad` of the parameter
    tensors got a gradient (only layers off the model's path, e.g. vision layers after the
    feature layer, get none), and each of those moved."""
    assert len(ref.with_grad) > with_grad * len(ref.params), where
    assert not [k for k in ref.with_grad if torch.equal(ref.params[k], ref.init[k])], where


def assert_split_work(ref: Reference, per_rank: list[dict], where: str, *,
                      pooled: bool = False) -> None:
    """Sequence parallelism really split the work, which the loss and gradients cannot show:
    ZeRO sums the gradients of an SP group's ranks, so ranks that each computed the whole row
    would double the targets and the loss alike and still match the oracle.

    - each target token of a step was trained on exactly one rank (the ranks' targets add up to
      the reference's);
    - the ranks of a split row held different shards of it, each 1 / size of the padded row;
    - each rank's counts (`ds_omni.parallel.evidence`): Ulysses attention in every decoder layer
      of every split row, one resharding all-to-all per split row with items (at least that
      under the encoder pool, which exchanges over the whole pool), its piece of each long item;
      and the embedding rows sent between ranks are the rows received.
    """
    for step, want in enumerate(ref.targets):
        got = [r["targets"][step] for r in per_rank]
        assert sum(got) == want, (f"{where} step {step}: the ranks trained {sum(got)} target "
                                  f"tokens ({got}), the global batch has {want}: some were "
                                  "trained on more than one rank (or on none)")
    _assert_shards_differ(per_rank, where)
    for rank, r in enumerate(per_rank):
        counts = r["sp"]
        assert counts, f"{where} rank {rank}: the model reports no SP counts (sp_metrics)"
        assert counts["sp_ulysses_calls"] == r["ulysses_per_row"] * r["sp_rows"], (
            f"{where} rank {rank}: {counts['sp_ulysses_calls']} Ulysses attention calls for "
            f"{r['sp_rows']} split rows x {r['ulysses_per_row']}: a row ran without its group")
        exchanges, rows = counts["sp_reshard_exchanges"], r["rows_with_items"]
        assert exchanges >= rows if pooled else exchanges == rows, (
            f"{where} rank {rank}: {exchanges} resharding all-to-alls for {rows} split rows "
            "with encoder items")
        assert counts["sp_encoder_pieces"] == r["long_items"], (where, rank, counts)
        if "ring_per_row" in r:  # parallel.cp: every split row went around the whole ring
            assert counts["sp_ring_steps"] == r["ring_per_row"] * r["sp_rows"], (
                f"{where} rank {rank}: {counts['sp_ring_steps']} ring passes for {r['sp_rows']} "
                f"split rows x {r['ring_per_row']}: a ring step was skipped")
            assert counts["sp_ring_bytes"] > 0, (where, rank, counts)
    sent = sum(r["sp"]["sp_rows_sent"] for r in per_rank)
    assert sent == sum(r["sp"]["sp_rows_received"] for r in per_rank), (where, sent)


def _assert_shards_differ(per_rank: list[dict], where: str) -> None:
    """Every split row (`_record_shards`) is on each rank of its group, as a shard of its own."""
    rows: dict[tuple, dict[int, tuple[list[int], int]]] = {}
    for rank, r in enumerate(per_rank):
        for step, i, group, ids, row_len, real in r["shards"]:
            if group is not None:
                rows.setdefault((step, i, group), {})[rank] = (ids, row_len, real)
    assert rows, f"{where}: no row was split over an SP group"
    for (step, i, (first, size)), shards in rows.items():
        at = f"{where} step {step} micro-batch {i}, ranks {first}..{first + size - 1}"
        assert sorted(shards) == list(range(first, first + size)), f"{at}: {sorted(shards)} hold it"
        (row_len,) = {n for _, n, _ in shards.values()}
        assert all(len(ids) * size == row_len for ids, _, _ in shards.values()), (
            f"{at}: shards of {[len(ids) for ids, _, _ in shards.values()]} tokens, not 1/{size} "
            f"of the {row_len}-token row each")
        # tokens with their positions (two shards of image placeholders alone hold the same
        # ids); shards of padding alone may match (a short row under sp x cp)
        # under parallel.cp the row positions too: two zigzag shards may both be image tokens at
        # the same offsets of two samples
        tokens = [(tuple(ids), tuple(more["positions"]), tuple(more.get("slots", ())))
                  for ids, _, more in shards.values() if more["real"]]
        assert len(set(tokens)) == len(tokens), f"{at}: two ranks hold the same shard"
