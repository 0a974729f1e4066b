"""`mshpc plan`: memory, step time and MFU of every parallel layout, from formulas."""
