"""The notification framing and the JSON reader, compiled and run on their own."""

import pathlib
import shutil
import subprocess

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


@pytest.mark.skipif(not shutil.which("g++"), reason="g++ missing")
def test_codec(tmp_path):
    exe = tmp_path / "codec_test"
    subprocess.run(
        ["g++", "-std=c++20", "-O1", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined",
         f"-I{SRC}", str(pathlib.Path(__file__).with_name("codec_test.cpp")), "-o", str(exe)],
        check=True,
    )
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
