"""model.fused_kernels through the real CLI: the choice is logged once; without a toolchain
`auto` falls back with one line saying why, and `on` stops with a one-line error."""

from __future__ import annotations

from support.cli_runner import mshpc, read_metrics, train_args

# PATH without ninja or a compiler: the kernels cannot be built or loaded (torch runs ninja
# even for a cached build), which is the state of a machine without a toolchain.
NO_TOOLCHAIN = {"PATH": "/nonexistent"}


def kernel_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "fused kernels:" in line]


def run(tmp_path, cache, name, mode, env=None):
    args = train_args(tmp_path, cache, "train.steps=2", f"model.fused_kernels={mode}", name=name)
    return mshpc(*args, "--nproc", "1", env=env)


def test_auto_uses_the_kernels_and_says_so_once(tmp_path, corpus_cache):
    out = run(tmp_path, corpus_cache, "auto", "auto")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = kernel_lines(out.stderr)
    assert len(lines) == 1 and "fused kernels: on (model.fused_kernels=auto): CPU twins" in lines[0], lines


def test_without_a_toolchain_auto_falls_back_and_on_fails(tmp_path, corpus_cache):
    out = run(tmp_path, corpus_cache, "fallback", "auto", env=NO_TOOLCHAIN)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = kernel_lines(out.stderr)
    assert len(lines) == 1, lines
    assert "fused kernels: unavailable, using the pure-torch reference operators" in lines[0]
    assert "ninja is not on PATH" in lines[0]
    assert len(read_metrics(tmp_path / "fallback")) == 2  # and it trained
    out = run(tmp_path, corpus_cache, "strict", "on", env=NO_TOOLCHAIN)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("mshpc: error: KernelError: model.fused_kernels=on, but the kernels cannot be built: "
                           "ninja is not on PATH"), last
    assert "(choose 'auto'" in last
