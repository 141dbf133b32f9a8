"""``coda-cute report``: placeholder until the report lands (see issue 2)."""


def add_arguments(p):
    p.add_argument("--json", help="write the report as JSON here")


def run(args) -> int:
    raise SystemExit("coda-cute report is not implemented yet")
