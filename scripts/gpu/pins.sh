# Versions the GPU folders pin, sourced by prepare_offline.sh and prepare_fa4.sh: both bring Liger-Kernel, and a lease
# may install one folder over the other into the same site folder (pip --target skips what is there), so they must
# agree. 0.8.5: what the H200 leases measured.
LIGER_PIN=liger-kernel==0.8.5
