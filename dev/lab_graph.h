/* dev/lab_graph.h -- shared by the kernel labs: the time of one launch inside a captured graph (chain_lab, bulk_lab,
 * expert_lab), and of plain launches (few_lab, skinny_lab).
 * graph_us(graph, st, n, r): the graph (n launches) instantiated, replayed once to warm up, then r times between two
 * events; returns microseconds per launch and destroys the graph.
 * time_ms(f, reps): f(0) as a warm-up, then f(1) .. f(reps) between two events on the default stream; milliseconds per
 * call (f's argument picks a rotating copy of the weights, so L2 does not serve them).
 * lab_few_model(prop): the GpuModel fields that gemm() / gemm_few_launch read, for a lab that calls them outside a
 * model (few_lab, skinny_lab): bf16 activations, the few-token kernels on. Include after laguna.cu. */
#pragma once

static inline GpuModel lab_few_model(const cudaDeviceProp &prop) {
    GpuModel g = {};
    g.nsm = prop.multiProcessorCount;
    g.few = g.bf = 1;
    g.cc_major = prop.major;
    g.dup = -1;
    return g;
}

static inline double graph_us(cudaGraph_t graph, cudaStream_t st, int n, int r) {
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    CUDA_CHECK(cudaGraphLaunch(exec, st));             /* warm-up */
    CUDA_CHECK(cudaEventRecord(e0, st));
    for (int i = 0; i < r; i++) CUDA_CHECK(cudaGraphLaunch(exec, st));
    CUDA_CHECK(cudaEventRecord(e1, st));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    return ms * 1e3 / ((double)n * r);
}

template <typename F> static inline float time_ms(F f, int reps) {
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    f(0);
    CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < reps; i++) f(i + 1);
    CUDA_CHECK(cudaEventRecord(b));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
    return ms / reps;
}
