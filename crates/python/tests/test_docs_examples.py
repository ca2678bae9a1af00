"""The Python examples of the README and the user guide, each run as a user would paste it: in a
fresh interpreter, with nothing but the installed package. A change to the API that leaves an
example behind fails here. (The Rust examples are compiled and run by `cargo test --doc`.)

Only whole programs are run: README.md and docs/guide/*.md hold complete examples, while
crates/python/README.md shows fragments (names like `peer_metadata` come from the reader's
program) and is left out.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_mooncake import metadata_server  # noqa: F401  (a pytest fixture)

ROOT = Path(__file__).resolve().parents[3]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
# The metadata guide's example names the server its text tells the reader to start; the test
# starts one on a free port instead.
DOCUMENTED_METADATA_URL = "http://127.0.0.1:8080/metadata"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def examples():
    found = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        for block in BLOCK.finditer(text):
            line = text.count("\n", 0, block.start()) + 1
            found.append(pytest.param(block.group(1), id=f"{doc.relative_to(ROOT)}:{line}"))
    return found


def test_the_documents_hold_python_examples():
    # A renamed guide or a changed fence would otherwise leave this file testing nothing.
    assert len(examples()) >= 8


@pytest.mark.parametrize("code", examples())
def test_documented_example_runs(code, metadata_server, tmp_path):  # noqa: F811
    url, _store = metadata_server
    script = tmp_path / "example.py"
    script.write_text(code.replace(DOCUMENTED_METADATA_URL, url))
    env = dict(os.environ)
    env.pop("MULTIRAIL_CONF", None)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
