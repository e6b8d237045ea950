"""More models than slots: which models page out (policy), where their state waits (store), its files."""
