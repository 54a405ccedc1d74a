"""benchmarks/bench_model.py end to end in its tiny configuration on the CPU (no timings asserted),
and `qpn bench model`'s wiring in the CLI."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from qpn.apps import cli, verify  # noqa: E402
from qpn.torch_bridge import QPNLinear  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_model.py"
BATCHES = (1, 2)
# prefill logits cosine with fp16 on the tiny model (measured 0.975 NVFP4, 0.998 FP8): a kernel or a
# layer copy that went wrong gives ~0.3 (a different model) or NaN, well below these
MIN_COS = {"fp16": 1.0 - 1e-12, "nvfp4": 0.9, "fp8": 0.99}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("qpn_bench_model_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_layer_gets_its_own_copy_of_layer_0s_packed_linears(bench):
    model = bench.build_model(bench.TINY, 3, torch.device("cpu"))
    linears = bench.variants(model)
    assert set(linears) == set(bench.FORMATS) and all(len(v) == 3 for v in linears.values())
    for fmt, layers in linears.items():
        first = layers[0]
        for layer in layers[1:]:
            for name in bench.LINEARS:
                module, original = layer[name], first[name]
                assert isinstance(module, QPNLinear if fmt != "fp16" else torch.nn.Linear), (fmt, name)
                for key, tensor in original.state_dict().items():  # equal bytes, separate memory
                    copy = module.state_dict()[key]
                    assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr(), (fmt, name, key)
    bench.install(model, linears["nvfp4"])
    assert all(isinstance(layer.get_submodule(name), QPNLinear) and layer.get_submodule(name).format == "nvfp4"
               for layer in model.model.layers for name in bench.LINEARS)


def test_tiny_run_writes_a_row_per_batch_and_format(bench, tmp_path, capsys):
    assert bench.main(["--tiny", "--device", "cpu", "--graphs", "manual", "--batches", ",".join(map(str, BATCHES)),
                       "--out", str(tmp_path), "--name", "tiny"]) == 0
    result = json.loads((tmp_path / "tiny.json").read_text())
    rows = result["sections"]["model"]["rows"]
    assert [(r["batch"], r["format"]) for r in rows] == [(b, f) for b in BATCHES for f in bench.FORMATS]
    for row in rows:
        assert row["finite"] is True and row["graphs"] == "eager loop (no CUDA)", row
        assert math.isfinite(row["ms"]) and row["ms"] > 0
        assert row["tok_s"] == pytest.approx(row["batch"] / row["ms"] * 1e3)
        assert math.isfinite(row["linears_ms"]) and row["linears_ms"] > 0  # the split of the step (no timing bound)
        assert row["rest_ms"] == pytest.approx(row["ms"] - row["linears_ms"])
        assert row["cos"] >= MIN_COS[row["format"]], row
        # fidelity: the quantized model against its W16 twin (qpn's own dequantized weights in fp16 linears)
        assert row["cos_w16"] == "" if row["format"] == "fp16" else row["cos_w16"] >= bench.FIDELITY_MIN, row
        fp16 = next(r for r in rows if r["batch"] == row["batch"] and r["format"] == "fp16")
        assert row["x_fp16"] == pytest.approx(fp16["ms"] / row["ms"])
    stored = {r["format"]: r["gb"] for r in rows if r["batch"] == 1}
    assert stored["nvfp4"] < stored["fp8"] < stored["fp16"]  # 0.56 / 1 / 2 bytes per decoder weight
    md = (tmp_path / "tiny.md").read_text()
    assert md.startswith("# qpn model benchmark: CPU")
    assert sum(line.startswith("| manual |") for line in md.splitlines()) == len(BATCHES) * len(bench.FORMATS)
    assert "every layer gets its own copy" in md
    assert "| manual | 2 | nvfp4 |" in capsys.readouterr().out


def test_the_moe_model_gives_every_layer_and_expert_its_own_copy_of_expert_0(bench):
    """Qwen3-MoE shapes: the experts module of every quantized layer is a QPNExperts whose every expert
    holds layer 0's expert 0 in separate memory; the fp16 model holds expert 0's weights in every expert."""
    from qpn.torch_bridge.experts import QPNExperts

    shape = bench.MODELS["qwen3moe"]
    model = bench.build_model(shape.tiny, 2, torch.device("cpu"), shape)
    modules = bench.variants(model, shape)
    fp16 = [layer[shape.experts] for layer in modules["fp16"]]
    assert all(torch.equal(e.gate_up_proj, e.gate_up_proj[:1].expand_as(e.gate_up_proj)) for e in fp16)
    assert torch.equal(fp16[0].down_proj, fp16[1].down_proj)
    for fmt in ("nvfp4", "fp8"):
        first, second = (layer[shape.experts] for layer in modules[fmt])
        assert isinstance(first, QPNExperts) and first.num_experts == shape.tiny["num_experts"], fmt
        for key, tensor in first.state_dict().items():
            assert torch.equal(tensor, tensor[:1].expand_as(tensor)), (fmt, key)  # expert 0 everywhere
            other = second.state_dict()[key]
            assert torch.equal(other, tensor) and other.data_ptr() != tensor.data_ptr(), (fmt, key)
    bench.install(model, modules["nvfp4"])
    quantized = bench.resident_bytes(model)
    bench.install(model, modules["fp16"])
    assert quantized < 0.5 * bench.resident_bytes(model)


def test_bench_model_rejects_a_bad_argument_with_exit_2(capsys):
    assert cli.main(["bench", "model", "--batches", "0"]) == 2
    assert "must be an integer in [1, 4096]" in capsys.readouterr().err


@pytest.mark.skipif(verify.cuda_status(need_torch=True)[0], reason="a CUDA GPU is present: bench model would run")
def test_bench_model_without_a_gpu_exits_3(capsys):
    assert cli.main(["bench", "model", "--tiny"]) == 3
    assert "needs a CUDA GPU" in capsys.readouterr().err
