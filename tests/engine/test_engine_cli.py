"""``halfmoon model create`` and ``halfmoon generate``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from halfmoon.cli import main


def test_model_create_then_generate_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_dir = tmp_path / "tiny"
    assert main(["model", "create", "--preset", "tiny", "--out", str(out_dir), "--seed", "3"]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out_dir / name).is_file(), name
    assert "chat_template" in json.loads((out_dir / "tokenizer_config.json").read_text())
    capsys.readouterr()
    argv = ["generate", "--model", str(out_dir), "--prompt", "Hello there", "--max-tokens", "5",
            "--temperature", "0.7", "--seed", "11", "--ignore-eos", "--json"]  # fmt: skip
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert set(first) == {"text", "token_ids", "finish_reason"}
    assert len(first["token_ids"]) == 5 and first["finish_reason"] == "length"
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == first  # seeded: same tokens again
    assert main(argv[:-1]) == 0
    assert capsys.readouterr().out.rstrip("\n") == first["text"]
    # --lora: the same request through a LoRA adapter (a PEFT directory) answers otherwise
    from halfmoon.engine.loader import preset_config
    from halfmoon.engine.lora import write_random_adapter

    adapter = write_random_adapter(preset_config("tiny"), tmp_path / "adapter", std=0.3)
    assert main([*argv, "--lora", str(adapter)]) == 0
    adapted = json.loads(capsys.readouterr().out)
    assert len(adapted["token_ids"]) == 5 and adapted["token_ids"] != first["token_ids"]
    assert main([*argv, "--lora", str(tmp_path)]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--model", "nope", "--prompt", "x"], "unknown model 'nope'"),
        (["generate", "--model", "tiny", "--prompt", "x", "--max-tokens", "0"], "max_tokens"),
        (["generate", "--model", "tiny", "--prompt", "x", "--device", "tpu"], "unknown device"),
    ],
)
def test_bad_input_is_one_line_error(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("halfmoon: error:") and message in err


@pytest.mark.slow  # a subprocess
def test_registering_commands_does_not_import_torch() -> None:
    code = "import sys, halfmoon.cli as c; c.build_parser(); print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
