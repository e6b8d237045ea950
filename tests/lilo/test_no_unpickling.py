"""No client data is ever unpickled: nothing in lilo, cluster or serve loads pickles (requests are JSON or protobuf,
futures' payloads orjson with packed arrays, checkpoints safetensors and JSON). A static check of the source."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNPICKLING = re.compile(r"\bimport (c?pickle|dill|shelve|marshal)\b|\bfrom (c?pickle|dill|shelve|marshal) import"
                        r"|\btorch\.load\(|\bnp\.load\(|\bnumpy\.load\(|allow_pickle|\bjoblib\b")


def test_no_module_of_the_service_loads_a_pickle():
    sources = [path for package in ("lilo", "cluster", "serve") for path in (ROOT / package).rglob("*.py")]
    assert len(sources) > 20
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in sources
                 for number, line in enumerate(path.read_text().splitlines(), 1) if UNPICKLING.search(line)]
    assert offenders == []
