"""The shipped Prometheus configuration and alerting rules, checked and unit-tested by
Debian's promtool (the rules' end-to-end use is in tests/integrations/test_prometheus.py)."""

import shutil
import subprocess
from pathlib import Path

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (make system-deps installs prometheus)"
    return subprocess.run(
        [binary, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60
    )


def test_rules_and_config_check():
    rules = promtool("check", "rules", "alerts.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 6 rules found" in rules.stdout
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


def test_alerts_fire_when_they_should_and_not_before():
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_rule_is_caught(tmp_path):
    broken = tmp_path / "alerts.yml"
    text = (PROMETHEUS / "alerts.yml").read_text()
    broken.write_text(text.replace('up{job="kvpool-node"} == 0', 'up{job="kvpool-node" == 0'))
    result = promtool("check", "rules", str(broken))
    assert result.returncode != 0
