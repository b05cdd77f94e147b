"""Image style: FDA's amplitude spectra (LADD) and style augmentation."""
