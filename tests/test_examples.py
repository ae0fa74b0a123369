"""The examples under examples/ (layers, generation, migration) run in their short mode and say what
they promise: finite, falling loss; a KV cache consistent with recomputation; the migration checks."""

import importlib.util
import pathlib
import re

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
  spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_train_decoder_quick(capsys, tmp_path):
  pytest.importorskip("flax")
  pytest.importorskip("optax")
  plot = tmp_path / "loss.png"
  rc = _load("train_decoder").main(["--quick", "--plot", str(plot)])
  out = capsys.readouterr().out
  assert rc == 0, out
  # The baseline (Flax's attention + mask) is poisoned by the NaN padding; ours is not.
  assert re.search(r"nnx\.MultiHeadAttention \+ mask: nan", out), out
  m = re.search(r"summary: loss ([\d.]+) -> ([\d.]+) .* all losses and gradients finite: True", out)
  assert m, out
  assert float(m.group(2)) < float(m.group(1))
  assert "grads finite: False" not in out
  # Where attention runs is read off the lowered step: on a CPU, the pure-JAX path both ways.
  where = re.search(r"attention: forward on (GPU kernels|pure JAX), backward on (GPU kernels|pure JAX) \((\w+)\)", out)
  assert where, out
  if where.group(3) == "cpu":
    assert where.group(1, 2) == ("pure JAX", "pure JAX"), out
  try:
    import matplotlib  # noqa: F401 pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    assert "skipping the plot" in out
  else:
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kv_cache_generation_quick(capsys):
  pytest.importorskip("flax")
  pytest.importorskip("optax")
  rc = _load("kv_cache_generation").main(["--quick"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "cache consistent with recompute: True" in out
  assert "cache lengths after generation: [7, 11, 6, 9]" in out  # prompts [3, 7, 2, 5] + 4
  assert re.search(r"training attention: forward on .*, backward on .*\n", out), out
  assert re.search(r"decoding attention: forward on (GPU kernels|pure JAX) \(\w+\)", out), out


def test_migrate_from_jax_nn(capsys):
  rc = _load("migrate_from_jax_nn").main(["--quick"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "migration checks passed" in out
  assert re.search(r"jax_padsafe: NaN in valid output rows\s+0, in valid gradient rows\s+0, "
                   r"output bitwise unchanged: True", out), out


@pytest.mark.parametrize("poison", ["nan", "inf", "1e30"])
def test_padding_nan_demo(capsys, poison):
  """The README's main example: jax_padsafe's rows and gradients stay free of the poison written into the
  padding, padded output rows are exactly zero, and the output is bitwise the zero-padding one."""
  _load("padding_nan_demo").main(["--poison", poison])
  out = capsys.readouterr().out
  ours = out.split("== jax_padsafe.dot_product_attention")[1]
  counts = re.findall(r"NaN in (?:them|valid rows):\s+(\d+)", ours)
  assert len(counts) == 6 and all(c == "0" for c in counts), out
  assert "padded output rows are exactly zero: True" in out, out
  assert re.search(r"in the padding is bitwise identical to zero padding: True", out), out
