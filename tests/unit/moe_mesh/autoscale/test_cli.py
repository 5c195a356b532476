"""`moe-mesh autoscale`'s input refused before any loop runs: one line naming the flag, exit 2."""

import argparse
import json

import pytest

from common.errors import InvalidArgumentError
from moe_mesh.autoscale.cli import AutoscaleSettings, add_subcommand, controller_for, run_autoscale


def settings(**fields) -> AutoscaleSettings:
    return AutoscaleSettings(**fields)


@pytest.fixture
def ready(tmp_path):
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps({"experts": [{"experts": "0-1:0-3"}], "control": "127.0.0.1:1"}))
    return path


@pytest.mark.parametrize(
    ("fields", "flag", "message"),
    [
        ({}, "--ready-file", "or a --compose-file$"),
        ({"compose_file": "c.yml", "ready_file": "m.json"}, "--ready-file", "not both"),
        ({"compose_file": "c.yml"}, "--compose-file", "needs --plan and --prometheus"),
        ({"ready_file": "m.json", "target": 60}, "--target", "fraction of time, 0-1, not 60"),
    ],
)
def test_what_the_flags_cannot_mean(fields, flag, message):
    with pytest.raises(InvalidArgumentError, match=message) as e:
        controller_for(settings(**fields), print)
    assert e.value.field == flag


def test_a_plan_goes_with_compose_not_with_a_local_mesh(ready):
    with pytest.raises(InvalidArgumentError, match="go with --compose-file"):
        controller_for(settings(ready_file=ready, plan="plan.yaml"), print)


def test_a_bad_plan_is_the_command_s_input_error(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("image: x\n")
    s = settings(compose_file=tmp_path / "c.yml", plan=plan, prometheus="http://127.0.0.1:1")
    with pytest.raises(InvalidArgumentError, match="plan.yaml: model") as e:
        controller_for(s, print)
    assert e.value.field == "--plan"


def test_a_decisions_file_that_cannot_be_opened_names_the_flag(ready, tmp_path):
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    args = parser.parse_args(
        ["autoscale", "--ready-file", str(ready), "--decisions-file", str(tmp_path / "no" / "x")]
    )
    with pytest.raises(InvalidArgumentError, match="No such file") as e:
        run_autoscale(args)
    assert e.value.field == "--decisions-file"
