"""Every flag and PATH of `qpn pack / verify / inspect / demo` is checked by the parser (apps/arguments.py):
bad input is one line on stderr naming the argument, the rule and the value, and exit 2 - never a traceback
from deep inside a command (`qpn verify --seed -5` used to print numpy's and exit 1, "a check failed").

The commands run in-process through `cli.main(argv)`; a rejected argument stops before any folder is read,
so the folders named here need not exist.
"""

from __future__ import annotations

import pytest

from qpn.apps import cli

SEED_MAX = 2**64 - 1

BAD_ARGUMENTS = [  # (argv, how the argument is named, the rule's words)
    (["verify", "ckpt", "--seed", "-5"], "--seed", f"an integer in [0, {SEED_MAX}]"),
    (["verify", "ckpt", "--seed", str(SEED_MAX + 1)], "--seed", f"an integer in [0, {SEED_MAX}]"),
    (["verify", "ckpt", "--seed", "1" * 5000], "--seed", f"an integer in [0, {SEED_MAX}]"),  # past int()'s limit
    (["verify", "ckpt", "--seed", "1.5"], "argument --seed", "an integer"),
    (["verify", "ckpt", "--seed", "seven"], "argument --seed", "an integer"),
    (["verify", "ckpt", "--m", "0"], "argument --m", "in [1, 4096]"),
    (["verify", "ckpt", "--m", "-1"], "argument --m", "in [1, 4096]"),
    (["verify", "ckpt", "--m", "1,4097"], "argument --m", "in [1, 4096]"),
    (["verify", "ckpt", "--m", "1,,40"], "argument --m", "in [1, 4096]"),
    (["verify", "ckpt", "--m", "one"], "argument --m", "in [1, 4096]"),
    (["verify", "ckpt", "--m", ""], "argument --m", "in [1, 4096]"),
    (["inspect", "--dispatch", "--family", "bogus"], "argument --family", "cpu or sm_"),
    (["inspect", "--dispatch", "--family", "../sm_90"], "argument --family", "cpu or sm_"),
    (["inspect", "--dispatch", "--family", ""], "argument --family", "cpu or sm_"),
    (["demo", "--device", "gpu"], "argument --device", "invalid choice"),
    (["pack", "", "out"], "argument CHECKPOINT_DIR", "an empty name"),
    (["pack", "ckpt", ""], "argument OUT_DIR", "an empty name"),
    (["verify", ""], "argument PATH", "an empty name"),
    (["inspect", ""], "argument PATH", "an empty name"),
    (["demo", "--keep", ""], "argument --keep", "an empty name"),  # "" meant no --keep: nothing kept
    (["verify"], "arguments are required: PATH", "required"),
    (["frobnicate"], "argument COMMAND", "invalid choice"),
]


@pytest.mark.parametrize("argv, argument, rule", BAD_ARGUMENTS)
def test_a_bad_argument_is_one_line_naming_it_and_exits_2(capsys, argv, argument, rule):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert argument in err and rule in err, err


GOOD_ARGUMENTS = [  # (argv, attribute, parsed value): the edges of each rule are accepted
    (["verify", "ckpt", "--seed", "0"], "seed", 0),
    (["verify", "ckpt", "--seed", str(SEED_MAX)], "seed", SEED_MAX),
    (["verify", "ckpt", "--m", "1,4096"], "m", (1, 4096)),
    (["verify", "ckpt", "--m", " 8, 33 "], "m", (8, 33)),
    (["inspect", "--dispatch", "--family", "sm_75"], "family", "sm_75"),
    (["inspect", "--dispatch", "--family", "cpu"], "family", "cpu"),
    (["pack", "-", "out"], "checkpoint", "-"),  # a folder may be called "-"
]


@pytest.mark.parametrize("argv, attribute, value", GOOD_ARGUMENTS)
def test_the_edges_of_each_rule_are_accepted(argv, attribute, value):
    assert getattr(cli.build_parser().parse_args(argv), attribute) == value


def test_every_numeric_flag_has_a_checking_type():
    """A new numeric flag added without a rule (argparse's bare `type=int`) fails here."""
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, command in commands.items():
        for action in command._actions:
            assert action.type not in (int, float), f"qpn {name} {action.dest}: type={action.type.__name__}"


def test_the_rules_are_reusable_types():
    """The types live in apps/arguments.py, for the commands to come (`qpn quantize`) to take as they are."""
    import argparse

    from qpn.apps import arguments

    seed = arguments.integer_in(0, 7, "a seed")
    assert seed("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match=r"a seed must be an integer in \[0, 7\], got '8'"):
        seed("8")
