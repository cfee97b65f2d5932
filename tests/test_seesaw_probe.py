"""benchmarks/seesaw_probe.py: the seesaw protocol toy (q.k once a block, consumer i % 2 owns
block i) against the duplicated-scores form and a float64 reference."""
import jax
import jax.numpy as jnp
import pytest

from benchmarks import seesaw_probe as S


@pytest.mark.parametrize("B,N,reuse", [(1, 64, False), (1, 192, False), (1, 256, False),
                                        (1, 320, True)])
def test_forms_interpreted_bit_identical_no_race(B, N, reuse):
    """One block, odd and even block counts (the last block the first or the second
    consumer's), K tiles reused: every form within 1e-2 of float64 softmax attention, the
    seesaw forms bit for bit the duplicated form's, and the interpreter's race detector
    finds nothing (it does find one when the publish comes before the P store)."""
    errs = S.check_interpreted(B, N, seed=None, reuse=reuse)
    assert len(errs) == len(S.FORMS) and max(errs) < 1e-2


def test_forms_lower_for_the_gpu_and_bad_inputs_raise():
    q = jax.ShapeDtypeStruct((128, 64, 512), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((128, 320, 512), jnp.bfloat16)
    for f in S.FORMS:
        txt = jax.jit(lambda a, b, f=f: S.dense_attention(a, b, form=f)).trace(q, k).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in txt
    with pytest.raises(ValueError, match="form"):
        S.dense_attention(q, k, form="pingpong")
    with pytest.raises(ValueError, match="multiple of 64"):
        S.dense_attention(q, jax.ShapeDtypeStruct((128, 100, 512), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,reuse", [(3, 64, False), (5, 448, False), (128, 320, False),
                                        (7, 384, True)])
def test_gpu_forms_bit_identical(B, N, reuse):
    errs = S.check(*S.make_inputs(B * 7 + N, B, N, reuse), reuse=reuse)
    assert max(errs) < 1e-2
