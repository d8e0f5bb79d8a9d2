"""The GGUF pair llama.cpp serves an EAGLE-3 head with: a head that is not EAGLE-3, or no llama.cpp source,
is refused in one line; where llama.cpp's source is present ($EAGLE_LAB_LLAMA_CPP), the converted head has
the tensors, shapes, dtypes, vocabulary map and layer ids llama.cpp's EAGLE-3 loader reads."""

import os

import pytest
import torch
from transformers import AutoTokenizer

from eagle_lab.drafters.eagle.head import save_head
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.export import export, main
from eagle_lab.models import llama_cpp
from eagle_lab.models.embedded import smollm2_dir
from eagle_lab.models.target import Target
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A tiny Llama target with SmolLM2's tokenizer (one llama.cpp's converter recognises), saved as a Hugging
    Face directory and named by a target yaml, with an EAGLE-3 head (reduced draft vocabulary) and an EAGLE-2
    head for it."""
    root = tmp_path_factory.mktemp("gguf")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = build_tiny_model(TinyModelConfig(), vocab_size=len(tokenizer))
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    (root / "target.yaml").write_text(f"name: tiny_smol\nsource: pretrained\npath: {root / 'target'}\ndevice: cpu\n")
    target = Target(model, tokenizer, "tiny_smol")
    draft_ids = torch.arange(0, target.vocab_size, 4)
    save_head(new_head(target, kind="eagle3", draft_vocab_ids=draft_ids, seed=1), root / "eagle3")
    save_head(new_head(target, kind="eagle2", seed=1), root / "eagle2")
    return root, target, draft_ids


def test_format_gguf_refuses_what_llama_cpp_cannot_take(tiny_dirs, tmp_path, monkeypatch, capsys):
    root, _, _ = tiny_dirs
    monkeypatch.delenv(llama_cpp.ENV, raising=False)
    base = ["format=gguf", f"target={root / 'target.yaml'}", f"out={tmp_path / 'o'}"]
    assert main([f"head_path={root / 'eagle3'}", *base]) == 2
    assert "llama_cpp=DIR" in capsys.readouterr().err
    assert main([f"head_path={root / 'eagle3'}", *base, f"llama_cpp={tmp_path}"]) == 2
    assert "not a llama.cpp source directory" in capsys.readouterr().err
    (tmp_path / llama_cpp.CONVERTER).write_text("")  # a source directory in name only is enough to reach the check
    assert main([f"head_path={root / 'eagle2'}", *base, f"llama_cpp={tmp_path}"]) == 2
    assert "EAGLE-3 heads" in capsys.readouterr().err
    assert main([f"head_path={root / 'eagle3'}", *base, f"llama_cpp={tmp_path}", "target_outtype=q2"]) == 2
    assert "target_outtype" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(llama_cpp.ENV), reason=f"no llama.cpp source (${llama_cpp.ENV})")
def test_the_head_gguf_is_what_llama_cpps_eagle3_loader_reads(tiny_dirs, tmp_path):
    root, target, draft_ids = tiny_dirs
    out = export({"head_path": str(root / "eagle3"), "format": "gguf", "out": str(tmp_path),
                  "target": str(root / "target.yaml"), "dtype": "float32"})
    from gguf import GGUFReader

    head = GGUFReader(str(out / "head.gguf"))
    fields = {f.name: f for f in head.fields.values()}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "eagle3"
    layers = [int(fields["eagle3.target_layers"].parts[i][0]) for i in fields["eagle3.target_layers"].data]
    assert layers == list(new_head(target, kind="eagle3").arch.feature_layers)
    tensors = {t.name: t for t in head.tensors}
    hidden = target.config.hidden_size
    expected = {"fc.weight": (3 * hidden, hidden), "output_norm.weight": (hidden,),
                "output.weight": (hidden, draft_ids.numel()), "d2t": (draft_ids.numel(),),
                "blk.0.attn_norm.weight": (hidden,), "blk.0.attn_norm_2.weight": (hidden,),
                "blk.0.attn_q.weight": (2 * hidden, hidden), "blk.0.ffn_down.weight": None,
                "blk.0.ffn_gate.weight": None, "blk.0.ffn_up.weight": None, "blk.0.ffn_norm.weight": (hidden,)}
    for name, shape in expected.items():
        assert name in tensors, f"{name} missing from the head GGUF ({sorted(tensors)})"
        if shape is not None:
            assert tuple(int(n) for n in tensors[name].shape) == shape, name
    d2t = torch.as_tensor(tensors["d2t"].data.copy()).long()
    assert torch.equal(d2t, draft_ids)  # llama.cpp stores each draft token's absolute target id
    assert (out / "target-f32.gguf").stat().st_size > 0


def _speculative_tool():
    source = os.environ.get(llama_cpp.ENV)
    return llama_cpp.tool(llama_cpp.source_dir(source), "llama-speculative-simple") if source else None


@pytest.mark.slow
@pytest.mark.skipif(_speculative_tool() is None, reason="llama.cpp's llama-speculative-simple is not built")
def test_llama_cpp_loads_the_pair_and_drafts_with_the_head(tiny_dirs, tmp_path):
    import re
    import subprocess

    root, _, _ = tiny_dirs
    out = export({"head_path": str(root / "eagle3"), "format": "gguf", "out": str(tmp_path),
                  "target": str(root / "target.yaml"), "dtype": "float32"})
    (tmp_path / "prompt.txt").write_text("The quick brown fox")
    done = subprocess.run([str(_speculative_tool()), "-m", str(out / "target-f32.gguf"), "-md", str(out / "head.gguf"),
                           "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3", "-f", str(tmp_path / "prompt.txt"),
                           "-n", "16", "-t", "1", "--temp", "0", "--ignore-eos"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", done.stderr + done.stdout)
    assert drafted and int(drafted.group(1)) > 0  # the head was loaded and drafted
