"""Drop-in modules with the Python APIs serving engines already call (dsv4.compat.flash_mla)."""
