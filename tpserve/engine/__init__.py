"""Pure-Python engine: requests, sequences, block manager, scheduler, detokenizer. No torch."""
