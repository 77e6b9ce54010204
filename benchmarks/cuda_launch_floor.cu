// What a decode step's hand-overs cost without any work (benchmarks/cuda_launch_floor.py): kernels chained
// under programmatic dependent launch that only wait, read what their predecessor wrote, or merge a tile's K
// splits as the forward does (common.cuh's arrive_last, merge.cuh's tagged slots and cluster push), each split's
// partial a value of that predecessor's. Appended to the forward's common.cuh and merge.cuh.

#define FLOOR_TN 128  // a tile's columns

// The PDL hand-over alone.
extern "C" __global__ void floor_empty(float* buf, float* part, int* counters) {
    grid_dep_launch();
    grid_dep_wait();
}

// Plus one L2 round trip: a value the predecessor wrote, and a store the successor reads.
extern "C" __global__ void floor_round_trip(float* buf, float* part, int* counters) {
    grid_dep_launch();
    grid_dep_wait();
    const int b = blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) buf[b] = __ldcg(buf + b) + 1.f;
}

// Tile blockIdx.x's gridDim.y splits merged by the last to arrive (decode attention's, the router's, the
// L2 GEMV merge): partials through L2, one atom.acq_rel, the last block loading every split's at once.
extern "C" __global__ void floor_counter_merge(float* buf, float* part, int* counters) {
    __shared__ int s_last;
    grid_dep_launch();
    grid_dep_wait();
    const int tid = threadIdx.x, tile = blockIdx.x, ns = gridDim.y;
    float* tp = part + (size_t)tile * ns * FLOOR_TN + tid;
    if (tid < FLOOR_TN) tp[(size_t)blockIdx.y * FLOOR_TN] = __ldcg(buf + (size_t)tile * FLOOR_TN + tid) + blockIdx.y;
    if (!arrive_last(&counters[tile], ns, &s_last)) return;
    if (tid < FLOOR_TN) {
        float v[16], s = 0.f;
#pragma unroll
        for (int y = 0; y < 16; ++y) v[y] = y < ns ? __ldcg(tp + (size_t)y * FLOOR_TN) : 0.f;
#pragma unroll
        for (int y = 0; y < 16; ++y) s += v[y];
        buf[(size_t)tile * FLOOR_TN + tid] = s;
    }
    if (tid == 0) counters[tile] = 0;
}

// The same splits as one thread block cluster (the M = 1 GEMV's): each pushes its partial into block 0's
// shared memory and exits; block 0 adds them in rank order.
extern "C" __global__ void floor_cluster_merge(float* buf, float* part, int* counters) {
    __shared__ float s_push[MAX_CLUSTER][FLOOR_TN];
    __shared__ __align__(8) unsigned long long s_bar;
    const int tid = threadIdx.x, tile = blockIdx.x;
    const unsigned csize = cluster_size(), rank = cluster_rank();
    if (rank == 0 && tid == 0) {
        mbar_init(&s_bar, 1);
        mbar_init_fence();
        mbar_expect_tx(&s_bar, (csize - 1) * FLOOR_TN * sizeof(float));
    }
    cluster_arrive();
    grid_dep_launch();
    grid_dep_wait();
    const float acc = tid < FLOOR_TN ? __ldcg(buf + (size_t)tile * FLOOR_TN + tid) + rank : 0.f;
    if (rank != 0) {
        cluster_wait();
        if (tid < FLOOR_TN) push_to_rank0(&s_push[rank][tid], &s_bar, acc);
        return;
    }
    mbar_wait(&s_bar, 0);
    if (tid < FLOOR_TN) {
        float s = acc;
        for (unsigned r = 1; r < csize; ++r) s += s_push[r][tid];
        buf[(size_t)tile * FLOOR_TN + tid] = s;
    }
}

// The same splits through tagged slots (merge.cuh, the GEMV merge of multi-wave grids): each split stores its
// partial with the launch's tag and exits, no fence or counter; the tile's last split polls every split's slot
// until all carry the tag. counters[tile] is the tile's epoch.
extern "C" __global__ void floor_tagged_merge(float* buf, float* part, int* counters) {
    grid_dep_launch();
    grid_dep_wait();
    const int tid = threadIdx.x, tile = blockIdx.x, ns = gridDim.y;
    const unsigned tag = (unsigned)__ldcg(counters + tile) + 1;
    unsigned long long* slots = reinterpret_cast<unsigned long long*>(part) + (size_t)tile * 16 * FLOOR_TN + tid;
    if (tid < FLOOR_TN)
        st_tagged(slots + (size_t)blockIdx.y * FLOOR_TN, __ldcg(buf + (size_t)tile * FLOOR_TN + tid) + blockIdx.y,
                  tag);
    if ((int)blockIdx.y != ns - 1) return;
    if (tid < FLOOR_TN) buf[(size_t)tile * FLOOR_TN + tid] = sum_tagged<16>(slots, FLOOR_TN, ns, tag);
    __syncthreads();
    if (tid == 0) counters[tile] = (int)tag;
}
