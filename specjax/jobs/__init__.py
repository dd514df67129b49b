"""What the launchers in experiments/ run: one function of an ml_collections config per job."""
