"""The README's usage example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    rb = namespace["rb"]
    assert len(rb) == 128  # the complete group was released to storage
    adv = rb[:]["advantage"]
    assert adv.shape == (128, 1) and abs(float(adv.mean())) < 1e-5
