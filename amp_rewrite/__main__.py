from ._console import main

raise SystemExit(main())
