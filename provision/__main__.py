from provision.cli import script

raise SystemExit(script())
