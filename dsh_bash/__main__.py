"""`python -m dsh_bash`: the dsh-bash command line."""

from ._cli import main

raise SystemExit(main())
