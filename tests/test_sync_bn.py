"""--sync-bn on 2 gloo ranks: the model converts every BN, evaluates, and (CPU) cannot train."""
from conftest import run_script


def test_sync_bn_model_on_two_gloo_ranks():
    proc = run_script(["torchrun", "--standalone", "--nproc_per_node=2", "tests/sync_bn_check.py"], timeout=120)
    assert "sync-bn check ok" in proc.stdout
