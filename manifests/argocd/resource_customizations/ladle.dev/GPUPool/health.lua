-- Argo CD health of a Ladle GPUPool, from the Ready and Degraded conditions the operator writes.
local hs = {status = "Progressing", message = "Waiting for the operator to report status"}

if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil then
  hs.message = "Being deleted"
  return hs
end
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local generation = obj.metadata and obj.metadata.generation
if generation ~= nil and obj.status.observedGeneration ~= generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local ready = nil
local degraded = nil
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Ready" then
    ready = condition
  elseif condition.type == "Degraded" then
    degraded = condition
  end
end
local function describe(condition)
  local text = condition.reason or condition.type
  if condition.message ~= nil and condition.message ~= "" then
    text = text .. ": " .. condition.message
  end
  return text
end

-- Over quota or over-committed: services in the pool run fewer replicas than they ask for.
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded)
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end
-- No node offers the pool's GPUs: nothing placed in it can run.
if ready ~= nil and ready.status == "False" then
  hs.status = "Degraded"
  hs.message = describe(ready)
  return hs
end
hs.message = "Waiting for the Ready condition"
return hs
