/* dev/lab_graph.h -- shared by the kernel labs (chain_lab, bulk_lab): the time of one launch inside a captured graph.
 * graph_us(graph, st, n, r): the graph (n launches) instantiated, replayed once to warm up, then r times between two
 * events; returns microseconds per launch and destroys the graph. Include after laguna.cu (CUDA_CHECK). */
#pragma once

static double graph_us(cudaGraph_t graph, cudaStream_t st, int n, int r) {
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
