from radixserve.client.cli import main

raise SystemExit(main())
