"""common: what every room shares; imports nothing from pdserve."""
