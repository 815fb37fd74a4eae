set terminal pngcairo size 1400,600 font ",10"
set output "bench_h200.png"
set title "gemvz z12 GEMV speedup on an H200 (CUDA graphs, weights rotated through 512 MiB)"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set ylabel "speedup (time of baseline / time of z12)"
set yrange [0:1.8]
set xtics rotate by -45 font ",8"
set grid ytics
set key top left
set arrow from graph 0, first 1.333 to graph 1, first 1.333 nohead dt 2 lc rgb "gray40"
set label "dashed: 1.333x, the byte ratio" at graph 0.35, first 1.72 tc rgb "gray40"
plot "bench_h200.dat" using 3:xtic(2) title "over cuBLAS BF16", "" using 4 title "over gemvz plain BF16"
