"""What a compiled step costs (memory, collectives, FLOPs from the HLO) and the throughput formulas."""
