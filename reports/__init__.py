"""Reports: one function per Plotly figure and one self-contained HTML assembler."""
