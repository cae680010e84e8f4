"""Stage partitioners (gpp, pipedream, piper, gpipe) and the CP-SAT co-optimiser (DESIGN §6, §7)."""
