"""`WorkloadSpec.draw`'s two additions for benchmarks/balance.py, which draws its workload from
the simulator's: audio prompts of their own median (`prompt_median`), and a generator the caller
owns (each draw goes on where the last stopped)."""

import numpy as np

from ds_omni.sim.workload import WorkloadSpec

MIX = dict(image_fraction=0.5, audio_fraction=0.3)


def _audio_samples(samples) -> np.ndarray:
    """[N] bool: the samples that own an audio item."""
    audio = np.zeros(len(samples), dtype=bool)
    audio[samples.item_sample[samples.item_encoder == "audio"]] = True
    return audio


def test_prompt_median_moves_the_audio_samples_only():
    plain = WorkloadSpec(**MIX).draw(4000, seed=5)
    same = WorkloadSpec(**MIX, prompt_median=200.0).draw(4000, seed=5)  # = caption_median
    short = WorkloadSpec(**MIX, prompt_median=20.0).draw(4000, seed=5)
    assert np.array_equal(plain.tokens, same.tokens)
    audio = _audio_samples(plain)
    assert 0.2 < audio.mean() < 0.4, audio.mean()  # the mix holds audio samples to compare
    # the same random draws: every other sample is untouched, each audio one has shorter text
    assert np.array_equal(short.tokens[~audio], plain.tokens[~audio])
    assert (short.tokens[audio] <= plain.tokens[audio]).all()
    assert np.median(plain.tokens[audio] - short.tokens[audio]) > 50
    assert np.array_equal(short.item_len, plain.item_len)  # the clips themselves are the same


def test_a_generator_is_drawn_from_where_it_stands():
    spec = WorkloadSpec(**MIX)
    rng = np.random.default_rng(11)
    first, second = spec.draw(300, rng), spec.draw(300, rng)
    assert np.array_equal(first.tokens, spec.draw(300, seed=11).tokens)  # as seeded afresh
    assert not np.array_equal(first.tokens, second.tokens)  # the stream went on
    again = np.random.default_rng(11)
    spec.draw(300, again)
    assert np.array_equal(spec.draw(300, again).tokens, second.tokens)
