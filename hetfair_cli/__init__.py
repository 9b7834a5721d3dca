"""Console scripts of hetfair: thin mains around the library."""
