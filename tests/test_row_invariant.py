"""The oracle's tool itself (tests/row_invariant.py): under RowInvariant a row's products and pointwise math equal
those of the row alone, whatever the rows beside it, and dtypes come out as without the mode."""

import pytest
import torch

from tests.row_invariant import RowInvariant


@pytest.mark.parametrize("m", [2, 3, 15, 48])
def test_rows_equal_the_row_alone(m):
    gen = torch.Generator().manual_seed(m)
    x, w, bias = torch.randn(m, 128, generator=gen), torch.randn(384, 128, generator=gen), torch.randn(384, generator=gen)
    q, k = torch.randn(4, m, 64, generator=gen), torch.randn(4, 64, 40, generator=gen)
    with RowInvariant():
        outs = [torch.nn.functional.linear(x, w, bias), torch.sigmoid(x), torch.nn.functional.silu(x), torch.rsqrt(x.abs() + 1),
                torch.einsum("hmd,hdn->hmn", q, k)]
        alone = [[torch.nn.functional.linear(x[i:i + 1], w, bias)[0], torch.sigmoid(x[i:i + 1])[0],
                  torch.nn.functional.silu(x[i:i + 1])[0], torch.rsqrt(x[i:i + 1].abs() + 1)[0],
                  torch.einsum("hmd,hdn->hmn", q[:, i:i + 1], k)[:, 0]] for i in range(m)]
    for j, out in enumerate(outs):
        for i in range(m):
            row = out[:, i] if j == 4 else out[i]
            assert torch.equal(row, alone[i][j]), (j, i)
    torch.testing.assert_close(outs[0], torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_dtypes_and_values_as_without_the_mode():
    x = torch.randn(5, 7)
    with RowInvariant():
        got = (x > 0, x.to(torch.bfloat16), x + 1, (x * 3).dtype, torch.exp(x))
    assert got[0].dtype == torch.bool and torch.equal(got[0], x > 0)
    assert got[1].dtype == torch.bfloat16 and torch.equal(got[1], x.to(torch.bfloat16))
    assert torch.equal(got[2], x + 1) and got[3] == torch.float32  # + - * / are correctly rounded either way
    torch.testing.assert_close(got[4], torch.exp(x))
