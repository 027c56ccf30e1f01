"""Data shipped with ragblend: the demo's MuSiQue cases (see README.md here)."""
