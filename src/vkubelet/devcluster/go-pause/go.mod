// Builds the pause program of the dev clusters' local pause image (the pod sandbox's first
// process): no registry is reachable, so the image is made here from this program.
module vkubelet.local/tools/pause

go 1.26.0
