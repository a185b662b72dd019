"""Every benchmark script still imports: they reach into the package's modules, which a move of the tree
would otherwise break unseen until someone runs them."""

import importlib.util
import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")
SCRIPTS = sorted(name for name in os.listdir(BENCHMARKS) if name.endswith(".py"))


def load(script: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(BENCHMARKS)  # as when run: a script imports its siblings
    spec = importlib.util.spec_from_file_location(
        f"benchmark_{script.removesuffix('.py')}", os.path.join(BENCHMARKS, script)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_imports(script, monkeypatch):
    assert callable(getattr(load(script, monkeypatch), "main", None)), f"{script} has no main()"


def test_the_published_fsdp_cache_digest_reads_the_analysis_sources(monkeypatch):
    """The cache key hashes the analysis passes and the zoo by path: a moved file must fail here, not in a run."""
    module = load("bench_published_fsdp.py", monkeypatch)
    sources = module._imported_sources(
        os.path.join(module.PACKAGE, "frontend", "passes", "__init__.py")
    )
    assert any(path.endswith(os.path.join("frontend", "passes", "blocks.py")) for path in sources)
    assert len(module.analysis_digest()) == 16
